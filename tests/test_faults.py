"""Fault injection: one rank of a MerakTrainer job stopped (SIGSTOP) or killed (SIGKILL) in the
middle of a step, of evaluation or of a save, at pp=2 and dp2 x pp2 (`fault_harness`, the
worker `fault_worker.py`, both in bench/). Every other rank must exit within the job's timeout
(ddp_timeout) plus a few seconds, its error naming the rank that did not arrive.

Five scenarios, each in a launch of its own (about three minutes in all on 2 cores);
bench/fault_sweep.py runs every point x kind x layout, and the 4-rank headline check.
"""

from __future__ import annotations

import pytest
from fault_harness import launch

TIMEOUT_S = 10  # ddp_timeout: above the slowest step of a loaded 2-core machine
# a stopped rank is found out after the timeout, then 2 s of beacon reads; a rank whose
# connection closes at once; then the process's exit
SLACK_S = 12


@pytest.mark.parametrize("world,pp,fault", [
    (2, 2, "1:backward:3:stop"),        # pp=2: the last stage stops in a backward
    (2, 2, "1:evaluation:2:kill"),      # pp=2: killed in evaluation's pipeline
    (2, 2, "0:save:3:kill"),            # pp=2: killed while saving a checkpoint
    (4, 2, "2:reduce_grads:3:stop"),    # dp2 x pp2: stopped in the step tail (dp all-reduce)
    (4, 2, "3:step_begin:3:stop"),      # dp2 x pp2: before the step's token-count all-reduce
], ids=lambda v: str(v).replace(":", "-"))
def test_every_rank_ends_in_time_naming_the_missing_peer(tmp_path, world, pp, fault):
    missing = int(fault.split(":")[0])
    outcome = launch(tmp_path, world, pp, fault, TIMEOUT_S)
    assert outcome.fault is not None, f"the fault was not injected\n{outcome.summary()}"
    for rank in range(world):
        if rank == missing:
            continue
        assert rank in outcome.exit_after_s, f"rank {rank} did not exit\n{outcome.summary()}"
        assert outcome.codes[rank] != 0, outcome.summary()
        assert outcome.exit_after_s[rank] < TIMEOUT_S + SLACK_S, outcome.summary()
        assert outcome.named(rank, missing), \
            f"rank {rank}'s error does not name rank {missing}\n{outcome.output[rank][-3000:]}"
    # a stopped rank is diagnosed by each survivor's host deadline (below the job's timeout;
    # NCCL's waits never end in Python without it), before gloo's own timeout
    if fault.endswith(":stop"):
        assert any("the host's deadline" in outcome.output[r] for r in outcome.output
                   if r != missing), outcome.summary()


def test_the_report_names_stopped_dead_and_gone_ranks_first():
    import time

    from merak.distributed.peer_report import describe

    now = time.time()
    beat = {"state": "running", "where": "training step 3 > backward of micro-batch 1 on "
                                          "stage 1", "message": "", "pid": 7, "host": "n1"}
    first = {0: {**beat, "n": 5, "t": now}, 1: {**beat, "n": 9, "t": now - 21},
             2: {**beat, "n": 4, "t": now}, 3: {**beat, "n": 8, "t": now}}
    second = {**first, 0: {**beat, "n": 6, "t": now}, 2: {**beat, "n": 5, "t": now},
              3: {**beat, "state": "exited", "message": "ValueError: bad", "n": 8, "t": now}}
    text = describe(0, "the dp gradient all-reduce", 20.04, 20.0, RuntimeError(
        "[gloo] Timed out waiting 20000ms for recv operation to complete"), [0, 2], first,
        second)
    assert text.startswith("rank 0 gave up on the dp gradient all-reduce after 20.0 s (the "
                           "job's timeout: 20 s") and "waiting for rank(s) [2]" in text
    assert "rank(s) [1, 3] did not arrive. rank 1 does not answer: its sign of life stopped " \
           "21 s ago, last in training step 3 > backward of micro-batch 1 on stage 1" in text
    assert "rank 3 has exited after ValueError: bad" in text and "raise ddp_timeout" in text
    assert "(backend: [gloo] Timed out waiting 20000ms" in text
    gave_up = {**second, 1: {**beat, "state": "failed", "message": "rank 1 gave up: rank(s) "
                             "[3] did not arrive", "n": 9, "t": now}, 3: second[0]}
    assert "rank 1 gave up first: rank 1 gave up: rank(s) [3]" in describe(
        0, "x", 1.0, 20.0, None, [1], first, gave_up)
    alive = {**second, 1: second[0], 3: second[0]}
    assert "although every rank answers: rank 2 is alive, in training step 3" in describe(
        0, "x", 1.0, 20.0, None, [2], first, alive)
    assert "the job's store at" in describe(0, "x", 1.0, 20.0, None, [1], "the job's store at "
                                            "h:1 did not answer", "the job's store at h:1")


def test_one_timeout_on_every_group_and_failures_become_peer_failure_errors():
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    import merak
    from merak.distributed import liveness, timeouts

    merak.init(dp=1, tp=1, pp=1)
    before = timeouts.set_job_timeout()
    try:
        extra = dist.new_group([0])  # torch's default timeout (30 minutes), not the world's
        assert timeouts.set_job_timeout(7) == 7.0
        for group in (None, extra, merak.get_context().pp_group):
            backend = (group or dist.distributed_c10d._get_default_group())._get_backend(
                torch.device("cpu"))
            assert backend.options._timeout == datetime.timedelta(seconds=7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            timeouts.given_to_init(9)
            timeouts.use_trainer_timeout(1800)  # HF's default keeps merak.init's
            assert liveness.job_timeout_s() == 7.0 and not caught
            timeouts.use_trainer_timeout(5)  # set: ddp_timeout wins, and says so
            assert liveness.job_timeout_s() == 5.0
            assert "merak.init(timeout=9) and MerakArguments.ddp_timeout=5 differ" in \
                str(caught[0].message)
        with pytest.raises(liveness.PeerFailureError, match=r"rank 0 gave up on a test wait "
                           r"after 0\.\d s \(the job's timeout: 5 s.*Connection closed by peer"):
            with liveness.waiting("a test wait"):
                raise RuntimeError("[gloo/pair.cc:537] Connection closed by peer [10.0.0.2]:41")
        with pytest.raises(RuntimeError, match="^an ordinary error$"):  # not a peer's
            with liveness.waiting("a test wait"):
                raise RuntimeError("an ordinary error")
    finally:
        timeouts._init_timeout = None
        timeouts.set_job_timeout(before)


def test_the_host_deadline_comes_before_the_backend_timeout_and_counts_from_progress():
    from types import SimpleNamespace

    from merak.distributed.liveness import Beacon, host_deadline_s

    assert host_deadline_s(10) == 7.0 and host_deadline_s(1800) == 1770.0
    assert host_deadline_s(100) == 90.0 and host_deadline_s(2) == 1.0
    stalled = SimpleNamespace(labels=["training step 3"], opened=[100.0], detail_since=105.0)
    assert Beacon.stalled_s(stalled, 112.0) == 7.0  # since the last action, not the block
    assert Beacon.stalled_s(SimpleNamespace(labels=[], opened=[], detail_since=0.0), 1e9) == 0
