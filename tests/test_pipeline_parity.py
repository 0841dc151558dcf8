"""Pipeline x data parallel training equals a single-process reference (CPU, gloo).

One torchrun launch per world size (2, 4, 8 ranks) runs every scenario of that size; see
workers/pipeline_parity.py. Covered: pp in {2, 4} x dp in {1, 2} x {ds_default, 1f1b}, on a GPT
whose tied embedding/head sit on the first and last stage and on a model sending two tensors
between stages plus a skip connection (stage 0 -> 2); 3 SGD steps, losses, every gradient and
the final parameters compared here, from the figures the worker returns. Plus the p2p timeout
error, the host reads of a step and `init`'s positional order (what the worker saw, checked
here).
"""

from __future__ import annotations

import pytest
from dist_harness import assert_like_reference, launch, scenario_result
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
        if kind == "skip" and pp == "pp4":  # two tensors from stage 1 to 2, a skip 0 -> 2
            assert ours["skip_edge_0_2"] and ours["transfers_1_2"] == 2, \
                f"rank {rank}: {ours['split']}"
        if kind == "gpt":
            assert ours["tied_weights"], f"rank {rank}: the tied embedding/head was not detected"
        if dp != "dp1":  # every step's buckets all-reduced from the backward, into the buckets
            _overlapped(f"rank {rank}", ours)
            if kind == "gpt" and pp == "pp2":
                assert ours["dp_buckets"] > 2, f"rank {rank}: one bucket"


def _overlapped(where: str, ours: dict) -> None:
    """When each step's tail began, every bucket but the late ones (tied weights) had started
    its all-reduce, in order, from a gradient hook inside the last backward; at each optimizer
    step every bucket's all-reduce was launched, in order, and every averaged gradient is a
    view of its bucket's buffer."""
    assert len(ours["overlap_steps"]) == NUM_STEPS, f"{where}: {ours['overlap_steps']}"
    for tail in ours["overlap_tails"]:
        early, launched = tail["early"], tail["launched"]
        assert launched[:len(early)] == [[i, "backward"] for i in early], f"{where}: {tail}"
        assert len(launched) == len(early), f"{where}: {tail}"
    for step in ours["overlap_steps"]:
        assert step["launched"] == list(range(step["buckets"])), f"{where}: {step}"
        assert step["copied_grads"] == 0, f"{where}: a copied gradient: {step}"


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)
                          if s.startswith("host-reads-")])
def test_a_step_after_the_first_reads_only_its_loss(launches, world_size, scenario):
    """A 1F1B step after the first reads nothing from the device but the step's loss."""
    for rank, ours in enumerate(scenario_result(*launches(world_size), scenario)):
        for step, reads in enumerate(ours["reads"], start=1):
            assert reads == {"item": 1}, f"rank {rank}, step {step}: host reads {reads}"


@pytest.mark.parametrize("world_size", [4])
def test_init_takes_dp_tp_pp_in_order(world_size, launches):
    """``merak.init(2, 1, 2)`` is dp=2, tp=1, pp=2 (Merak's README order), ranks pp-major; a
    backend other than the running one, and sizes the world does not divide, are refused."""
    for rank, seen in enumerate(scenario_result(*launches(world_size), "context-positional-order")):
        where = f"rank {rank}: {seen}"
        assert seen["sizes"] == [2, 1, 2], where
        assert seen["rank"] == seen["world_rank"] == rank, where
        assert seen["rank"] == seen["pp_rank"] * 2 + seen["dp_rank"], where
        assert seen["first"] == (seen["pp_rank"] == 0), where
        assert seen["last"] == (seen["pp_rank"] == 1), where
        assert seen["dp_group_size"] == 2 and seen["pp_group_size"] == 2, where
        assert seen["other_stage_rank"] != seen["rank"], where
        refusal = seen["backend_refusal"]
        assert refusal is not None, f"rank {rank}: another backend was silently ignored"
        assert "already initialized with 'gloo'" in refusal, f"rank {rank}: {refusal}"
        for bad, refusal in zip(("dp=3 tp=1 pp=1", "dp=0 tp=4 pp=1"),
                                seen["bad_sizes_refusals"], strict=True):
            assert refusal is not None and "dp" in refusal, f"rank {rank}, {bad}: {refusal}"


@pytest.mark.parametrize("scenario", ALONE)
def test_scenario_alone(tmp_path, scenario):
    """A scenario that breaks the process group (a timed-out receive) in a launch of its own:
    stage 1 waits for activations stage 0 never sends, and fails once the process group's
    timeout (2 s) has passed, naming both ranks."""
    results, output = launch(WORKER, 2, tmp_path, args=["--only", scenario])
    # (stage 0 may not report: the group the timeout broke fails its closing barrier)
    ours = results.figures.get(scenario, [None, None])[1]
    assert ours is not None, f"stage 1 did not report\n{output[-3000:]}"
    message = ours["message"]
    assert message is not None, "stage 1 did not time out although stage 0 never sent"
    for part in ("rank 1 gave up on recv_act of micro-batch 0 (stage 1 <-> rank 0, stage 0) "
                 "after 2.", "the job's timeout: 2 s", "rank(s) [0]",
                 "although every rank answers: rank 0 is alive"):
        assert part in message, f"{part!r} missing from the timeout message: {message}"
    # the timeout, then two reads of the ranks' beacons 2 s apart
    assert ours["seconds"] < 9.0, f"the timeout of 2 s took {ours['seconds']:.1f} s to fire"
