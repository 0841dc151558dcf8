"""Installs the NCCL-contract test backend (nccl_contract.py) in every Python process of the
test suite, once torch.distributed is imported (tests/conftest.py puts this folder on
PYTHONPATH; MERAK_TEST_BACKEND=gloo leaves plain gloo). Processes that never import
torch.distributed pay nothing."""

import importlib.abc
import os
import sys

_MODULE = "torch.distributed"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps torch.distributed's loader so the backend installs right after it is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            import nccl_contract  # noqa: F401 - installs itself (or will, once imported)

        loader.exec_module = exec_module
        return spec


if os.environ.get("MERAK_TEST_BACKEND", "nccl-contract") == "nccl-contract":
    sys.meta_path.insert(0, _AfterImport())
