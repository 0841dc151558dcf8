"""Schedules as data: generation, validation and simulation, without any communication."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from merak import SCHEDULES, Action, ActionKind, CostModel, ScheduleError, make_schedule, simulate
from merak.schedule.validate import validate_schedule

K = ActionKind


def _sizes(info):
    """Pipeline ranks and stages per rank the schedule runs on (interleaved: 2 and 3 model
    chunks per rank, at least 2 ranks; the V-shaped: 2 per rank, 1 rank up)."""
    if info.fixed_stages_per_rank is not None:
        return [(p, info.fixed_stages_per_rank) for p in range(1, 9)]
    if info.several_stages_per_rank:
        return [(p, v) for p in range(2, 9) for v in (2, 3)]
    return [(p, 1) for p in range(1, 9)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_and_size_passes_the_nccl_replay(name):
    """Stages 1..8, micro-batches 1..16: every rank's program passes the FIFO/rendezvous replay
    (one ordered stream per rank, a send completes only when its receive runs)."""
    info = SCHEDULES[name]
    for p, v in _sizes(info):
        for m in range(1, 17):
            if info.several_stages_per_rank and m < p:
                continue
            schedule = make_schedule(name, p, m, stages_per_rank=v, recompute=True)
            report = validate_schedule(schedule)
            assert report.num_ranks == p and len(report.num_groups) == p
            result = simulate(schedule)
            if name == "1f1b":
                assert result.peak_activations == [min(p - s, m) for s in range(p)]
            if name == "ds_default":
                assert result.peak_activations == [m] * p


def _swap(schedule, rank, first, second):
    program = list(schedule.programs[rank])
    i, j = program.index(first), program.index(second)
    program[i], program[j] = program[j], program[i]
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return dataclasses.replace(schedule, programs=tuple(programs))


def _find(schedule, rank, kind, mb, **extra):
    return next(a for a in schedule.programs[rank]
                if a.kind is kind and a.microbatch_id == mb
                and all(getattr(a, k) == v for k, v in extra.items()))


def test_reordered_sends_that_would_swap_tensors_are_rejected():
    schedule = make_schedule("ds_default", 2, 2)
    # rank 1 runs micro-batch 1's forward first (a valid order for the stage alone), so it
    # posts the receive of micro-batch 1 while rank 0 sends micro-batch 0: NCCL would pair them
    swapped = tuple(dataclasses.replace(a, microbatch_id=1 - a.microbatch_id)
                    if a.kind in (K.RECV_ACT, K.LOAD, K.FORWARD) else a
                    for a in schedule.programs[1])
    bad = dataclasses.replace(schedule, programs=(schedule.programs[0], swapped))
    with pytest.raises(ScheduleError, match=r"rank 0 posts send_act\[0\].*rank 1 posts "
                                            r"recv_act\[1\]"):
        validate_schedule(bad)


def test_receive_before_send_on_both_sides_deadlocks():
    """The cyclic wait of receives posted ahead of sends: stage 0 waits for the gradient of
    micro-batch 0 before sending micro-batch 1, stage 1 for micro-batch 1 before sending the
    gradient."""
    schedule = make_schedule("1f1b", 2, 2)
    programs = [list(p) for p in schedule.programs]
    send1 = _find(schedule, 0, K.SEND_ACT, 1)
    recv0 = _find(schedule, 0, K.RECV_GRAD, 0)
    programs[0] = [a for a in programs[0] if a != send1]
    programs[0].insert(programs[0].index(recv0) + 1,
                       dataclasses.replace(send1, group=recv0.group + 100))
    sg0, ra1 = _find(schedule, 1, K.SEND_GRAD, 0), _find(schedule, 1, K.RECV_ACT, 1)
    programs[1] = [dataclasses.replace(a, group=a.group + 100) if a == sg0 else a
                   for a in programs[1]]
    programs[1].remove(dataclasses.replace(sg0, group=sg0.group + 100))
    programs[1].insert(programs[1].index(ra1) + 1, dataclasses.replace(sg0, group=ra1.group
                                                                       + 100))
    bad = dataclasses.replace(schedule, programs=tuple(tuple(p) for p in programs))
    with pytest.raises(ScheduleError, match="deadlock.*rank 0.*rank 1"):
        validate_schedule(bad)


@pytest.mark.parametrize("p,m", [(4, 8), (2, 8), (8, 16), (3, 5), (1, 4)])
def test_1f1b_bubble_closed_form(p, m):
    result = simulate(make_schedule("1f1b", p, m), CostModel(forward=1.0, backward=2.0))
    assert result.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert result.makespan == pytest.approx((m + p - 1) * 3.0)
    assert result.bubble_per_stage == pytest.approx([(p - 1) / (m + p - 1)] * p)


def test_p2p_time_and_uneven_stages_lengthen_the_makespan():
    schedule = make_schedule("1f1b", 4, 8)
    base = simulate(schedule, CostModel()).makespan
    assert simulate(schedule, CostModel(p2p=0.5)).makespan > base
    slow_last = CostModel(forward=[1, 1, 1, 2], backward=[2, 2, 2, 4])
    # the slowest stage bounds the pipeline: at least m * (its forward + backward)
    assert simulate(schedule, slow_last).makespan >= 8 * 6


def test_gpipe_and_1f1b_same_makespan_with_equal_costs():
    gpipe = simulate(make_schedule("ds_default", 4, 8), CostModel())
    one_f = simulate(make_schedule("1f1b", 4, 8), CostModel())
    assert gpipe.makespan == pytest.approx(one_f.makespan)
    assert gpipe.peak_activations == [8] * 4 and one_f.peak_activations == [4, 3, 2, 1]


def test_backward_before_forward_is_rejected():
    schedule = make_schedule("1f1b", 2, 2)
    bad = _swap(schedule, 1, _find(schedule, 1, K.FORWARD, 0), _find(schedule, 1, K.BACKWARD, 0))
    with pytest.raises(ScheduleError, match="micro-batch 0"):
        validate_schedule(bad)


def test_missing_receive_is_rejected():
    schedule = make_schedule("ds_default", 2, 2)
    recv = _find(schedule, 1, K.RECV_ACT, 1)
    programs = (schedule.programs[0], tuple(a for a in schedule.programs[1] if a != recv))
    with pytest.raises(ScheduleError, match="recv_act"):
        validate_schedule(dataclasses.replace(schedule, programs=programs))


def test_skip_edges_get_their_own_transfers():
    schedule = make_schedule("1f1b", 3, 4, edges={(0, 1), (1, 2), (0, 2)})
    validate_schedule(schedule)
    sends = [a for a in schedule.programs[0] if a.kind is K.SEND_ACT and a.microbatch_id == 0]
    assert sorted((a.peer, a.group) for a in sends) == [(1, sends[0].group), (2, sends[0].group)]
    with pytest.raises(ScheduleError):
        validate_schedule(dataclasses.replace(schedule, edges=frozenset({(0, 1), (1, 2)})))


def test_groups_pair_like_megatron():
    """Between a forward and the next backward, a middle rank posts its activation send and
    its gradient receive as one group."""
    schedule = make_schedule("1f1b", 3, 4)
    groups = [[str(a) for a in acts] for _, acts in schedule.groups(1)]
    assert ["send_act[1]@1->2", "recv_grad[0]@1<-2"] in groups  # after one warm-up forward
    assert ["send_grad[0]@1->0", "recv_act[2]@1<-0"] in groups


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="1f1b"):
        make_schedule("zigzag", 2, 2)


def test_cli_prints_the_closed_form_bubble(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "merak", "simulate", "--schedule", "1f1b", "--stages", "4",
         "--microbatches", "8", "--png", str(tmp_path / "t.png"),
         "--trace", str(tmp_path / "t.json")],
        capture_output=True, text=True, check=True).stdout
    assert "bubble (mean)       0.2727" in out
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert '"traceEvents"' in (tmp_path / "t.json").read_text()


def test_cli_prints_every_schedules_programs(capsys):
    from merak.cli import main as cli_main

    for name, info in SCHEDULES.items():
        argv = ["simulate", "--schedule", name, "--stages", "2", "--microbatches", "4",
                "--programs"]
        argv += ["--recompute-cost", "1"] if info.needs_recompute else []
        argv += ["--interleave", "2"] if info.several_stages_per_rank else []
        assert cli_main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert len(out["programs"]) == 2
        first = out["programs"][0][0]
        assert set(first) >= {"stage", "action", "microbatch", "peer", "group"}
        sends = [a for a in out["programs"][0] if a["action"] == "send_act"]
        assert sends and all(a["peer"] == 1 and a["group"] is not None for a in sends)


def test_idle_core_plan_finds_the_solo_actions():
    from merak.runtime.cpu_threads import IdleCoreLending, concurrent_ranks

    counts = concurrent_ranks(make_schedule("1f1b", 2, 8))
    solo = sorted((rank, str(action)) for (rank, action), n in counts.items() if n == 1)
    # warm-up forward on stage 0, first backward on stage 1 (stage 0 waits), drain on stage 0
    assert solo == [(0, "backward[7]@0"), (0, "forward[0]@0"), (1, "backward[0]@1")]
    hook = IdleCoreLending(make_schedule("1f1b", 2, 8), 1, ranks_per_stage=1, cores=2,
                           local_ranks=2)
    assert hook.base_threads == 1 and hook.threads == {Action(K.BACKWARD, 1, 0): 2}
