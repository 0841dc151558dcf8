"""GPU checks (`scripts/gpu_check.sh`): every test here is marked ``gpu`` and skipped without
CUDA, so the CPU suite collects them at no cost. A test marked ``lowtime`` (it runs the energy
planner) is skipped, saying why, where lowtime is not installed: the lent GPU image lacks it
and has no network, so it comes only as a carried wheel (scripts/gpu_wheels.sh)."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_check.sh on one")
    no_lowtime = pytest.mark.skip(
        reason="needs lowtime (the clock frontier's solver), not installed: run "
               "scripts/gpu_wheels.sh on a machine with network and carry .whl here")
    has_lowtime = importlib.util.find_spec("lowtime") is not None
    here = str(config.rootpath / "tests" / "gpu")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
            elif item.get_closest_marker("lowtime") and not has_lowtime:
                item.add_marker(no_lowtime)
