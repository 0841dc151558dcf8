"""The test backend with NCCL's point-to-point contract (tests/nccl_contract), which every
distributed test of the suite runs under: each property NCCL has and gloo lacks, shown on 2
ranks (workers/nccl_contract_check.py)."""

from __future__ import annotations

import pytest
from dist_harness import check, launch
from nccl_contract_check import ALONE, scenarios

WORKER = "nccl_contract_check.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2,)


@pytest.mark.parametrize("scenario", list(scenarios(2)))
def test_contract(launches, scenario):
    results, output = launches(2)
    check(results, output, scenario)


@pytest.mark.parametrize("scenario", ALONE)
def test_contract_alone(tmp_path, scenario):
    results, output = launch(WORKER, 2, tmp_path, args=["--only", scenario], timeout_s=120)
    check(results, output, scenario)
