"""Pipeline x data parallel training equals a single-process reference (CPU, gloo).

One torchrun launch per world size (2, 4, 8 ranks) runs every scenario of that size; see
workers/pipeline_parity.py. Covered: pp in {2, 4} x dp in {1, 2} x {ds_default, 1f1b}, on a GPT
whose tied embedding/head sit on the first and last stage and on a model sending two tensors
between stages plus a skip connection (stage 0 -> 2); 3 SGD steps, losses, every gradient and
the final parameters compared. Plus the p2p timeout error and `init`'s positional order.
"""

from __future__ import annotations

import pytest
from dist_harness import check, launch
from pipeline_parity import ALONE, scenario_names

WORKER = "pipeline_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4, 8)


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)])
def test_scenario(launches, world_size, scenario):
    results, output = launches(world_size)
    check(results, output, scenario)


@pytest.mark.parametrize("scenario", ALONE)
def test_scenario_alone(tmp_path, scenario):
    """A scenario that breaks the process group (a timed-out receive) in a launch of its own."""
    results, output = launch(WORKER, 2, tmp_path, args=["--only", scenario])
    check(results, output, scenario)
