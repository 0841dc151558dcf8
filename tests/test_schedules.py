"""Schedules as data: generation, validation and simulation, without any communication."""

from __future__ import annotations

import subprocess
import sys

import pytest

from merak import Action, ActionKind, CostModel, ScheduleError, make_schedule, simulate
from merak.pipeline.validate import validate_schedule

K = ActionKind


@pytest.mark.parametrize("name", ["ds_default", "1f1b"])
@pytest.mark.parametrize("num_stages", range(1, 9))
def test_every_size_validates(name, num_stages):
    for num_microbatches in range(1, 17):
        schedule = make_schedule(name, num_stages, num_microbatches)
        report = validate_schedule(schedule, num_microbatches)
        if name == "1f1b":
            expected = [min(num_stages - s, num_microbatches) for s in range(num_stages)]
        else:
            expected = [num_microbatches] * num_stages
        assert report.peak_activations == expected


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
    stage = schedule[1]
    f, b = stage.index(Action(K.FORWARD, 0)), stage.index(Action(K.BACKWARD, 0))
    stage[f], stage[b] = stage[b], stage[f]
    with pytest.raises(ScheduleError, match="micro-batch 0"):
        validate_schedule(schedule, 2)


def test_missing_receive_is_rejected():
    schedule = make_schedule("ds_default", 2, 2)
    schedule[1].remove(Action(K.RECV_ACT, 1))
    with pytest.raises(ScheduleError, match="recv_act"):
        validate_schedule(schedule, 2)


def test_unmatched_send_is_reported():
    from merak.pipeline.simulator import replay

    schedule = make_schedule("ds_default", 3, 2)
    schedule[2].remove(Action(K.RECV_ACT, 1))  # stage 1's send of micro-batch 1 goes unread
    with pytest.raises(ScheduleError, match="without a matching receive"):
        replay(schedule)


def test_deadlock_is_detected():
    # Stage 0 waits for the gradient of micro-batch 0 before sending its activation.
    schedule = make_schedule("1f1b", 2, 1)
    stage0 = schedule[0]
    stage0.remove(Action(K.RECV_GRAD, 0))
    stage0.insert(stage0.index(Action(K.SEND_ACT, 0)), Action(K.RECV_GRAD, 0))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(schedule, 1)


def test_skip_edges_need_their_messages():
    schedule = make_schedule("1f1b", 3, 4)
    validate_schedule(schedule, 4, edges={(0, 1), (1, 2), (0, 2)})
    with pytest.raises(ScheduleError):
        validate_schedule(schedule, 4, edges={(0, 1), (1, 2), (0, 3)})


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


def test_idle_core_plan_finds_the_solo_actions():
    from merak.pipeline.cpu_threads import IdleCoreLending, concurrent_stages

    counts = concurrent_stages(make_schedule("1f1b", 2, 8), None)
    solo = sorted((stage, str(action)) for (stage, action), n in counts.items() if n == 1)
    # warm-up forward on stage 0, first backward on stage 1 (stage 0 waits), drain on stage 0
    assert solo == [(0, "backward[7]"), (0, "forward[0]"), (1, "backward[0]")]
    hook = IdleCoreLending(make_schedule("1f1b", 2, 8), 1, ranks_per_stage=1, cores=2,
                           local_ranks=2)
    assert hook.base_threads == 1 and hook.threads == {Action(K.BACKWARD, 0): 2}
