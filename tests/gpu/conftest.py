"""GPU checks (`scripts/gpu_check.sh`): every test here is marked ``gpu`` and skipped without
CUDA, so the CPU suite collects them at no cost."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_check.sh on one")
    here = str(config.rootpath / "tests" / "gpu")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
