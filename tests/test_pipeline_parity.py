"""Pipeline x data parallel training equals a single-process reference (CPU, gloo).

One torchrun launch per world size (2, 4, 8 ranks) runs every scenario of that size; see
workers/pipeline_parity.py. Covered: pp in {2, 4} x dp in {1, 2} x {ds_default, 1f1b}, on a GPT
whose tied embedding/head sit on the first and last stage and on a model sending two tensors
between stages plus a skip connection (stage 0 -> 2); 3 SGD steps, losses, every gradient and
the final parameters compared here, from the figures the worker returns. Plus the p2p timeout
error, the host reads of a step and `init`'s positional order (checked in the worker).
"""

from __future__ import annotations

import pytest
from dist_harness import assert_like_reference, check, launch, scenario_result
from pipeline_parity import ALONE, NUM_STEPS, scenario_names

WORKER = "pipeline_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4, 8)
# every loss, gradient and final parameter against the single-process reference's:
# torch.testing.assert_close(ours, reference, rtol=RTOL, atol=ATOL)
RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)
                          if s.startswith("parity-")])
def test_scenario(launches, world_size, scenario):
    _, kind, pp, dp, _ = scenario.split("-")
    figures = scenario_result(*launches(world_size), scenario)
    assert assert_like_reference(figures, rtol=RTOL, atol=ATOL, grad_atol_of_max=0.0) > 0
    for rank, ours in enumerate(figures):
        assert len(ours["grad_snapshots"]) == NUM_STEPS, f"rank {rank}: {ours['grad_snapshots']}"
        assert all(ours["grad_snapshots"]), f"rank {rank}'s stage has no parameters"
        assert ours["params_without_grad"] == [], f"rank {rank}: {ours['params_without_grad']}"
        if dp != "dp1":  # every step's buckets all-reduced from the backward, into the buckets
            assert ours["overlap_checked_steps"] == NUM_STEPS, f"rank {rank}: {ours}"
            if kind == "gpt" and pp == "pp2":
                assert ours["dp_buckets"] > 2, f"rank {rank}: one bucket"


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)
                          if not s.startswith("parity-")])
def test_worker_checked_scenario(launches, world_size, scenario):
    check(*launches(world_size), scenario)


@pytest.mark.parametrize("scenario", ALONE)
def test_scenario_alone(tmp_path, scenario):
    """A scenario that breaks the process group (a timed-out receive) in a launch of its own."""
    results, output = launch(WORKER, 2, tmp_path, args=["--only", scenario])
    check(results, output, scenario)
