"""Interleaved 1F1B: the schedule as data (generation, validation, simulation, CLI), stage-aware
recomputation over a rank's several stages, and the runtime on CPU/gloo against the
single-process model (workers/interleaved_parity.py: one torchrun launch per world size, pp 2
and 4, 2 chunks per rank, Llama and GPT-2, 3 steps; the figures it returns compared here)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from dist_harness import assert_like_reference, scenario_result
from interleaved_parity import CHUNKS, FIRST_RATIO, V_SCHEDULES, VARIANTS, scenario_names

from merak import Action, ActionKind, CostModel, Schedule, ScheduleError, make_schedule, simulate
from merak.cli import main as cli_main
from merak.recompute.stage_aware import KeptBytes, choose_ratios, predict_peaks, stage_aware_ratios
from merak.schedule.validate import validate_schedule

K = ActionKind
WORKER = "interleaved_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)
# losses, eval losses and final weights: torch.testing.assert_close(ours, reference, rtol=RTOL,
# atol=ATOL); gradients with atol + GRAD_ATOL_OF_MAX x the reference gradient's largest entry
RTOL, ATOL, GRAD_ATOL_OF_MAX = 1e-4, 1e-5, 1e-4


def interleaved(p: int, m: int, v: int, recompute=False) -> Schedule:
    return make_schedule("interleaved_1f1b", p, m, stages_per_rank=v, recompute=recompute)


def test_bubble_is_half_of_1f1b_with_two_chunks():
    costs = CostModel(forward=1.0, backward=2.0)
    one_f = simulate(make_schedule("1f1b", 4, 8), costs)
    inter = simulate(interleaved(4, 8, 2), costs)
    ratios = [i / o for i, o in zip(inter.idle_per_stage, one_f.idle_per_stage)]
    print(f"\n1f1b idle per rank {one_f.idle_per_stage} (makespan {one_f.makespan}); "
          f"interleaved v=2 idle per rank {inter.idle_per_stage} (makespan {inter.makespan}); "
          f"ratio {ratios}")
    assert len(inter.idle_per_stage) == 4  # per rank, not per virtual stage
    assert all(0.4 <= r <= 0.6 for r in ratios), ratios
    assert inter.makespan < one_f.makespan
    assert inter.busy == pytest.approx(one_f.busy)  # the same work, split into chunks


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 4, 2), (8, 16, 2),
                                   (3, 9, 3)])
def test_idle_closed_form(p, m, v):
    """Each rank idles (p - 1)(f + b) / v: 1F1B's bubble, v-fold smaller."""
    result = simulate(interleaved(p, m, v), CostModel(forward=1.0, backward=2.0))
    assert result.idle_per_stage == pytest.approx([(p - 1) * 3.0 / v] * p)


@pytest.mark.parametrize("p", range(2, 7))
@pytest.mark.parametrize("v", [2, 3, 4])
def test_every_size_validates(p, v):
    for m in range(p, 4 * p + 1, p):
        schedule = interleaved(p, m, v)
        report = validate_schedule(schedule)
        assert (report.num_ranks, report.num_microbatches) == (p, m)
        assert all(n > 0 for n in report.num_groups)
        # Megatron's warm-up, 2 (p - r - 1) + (v - 1) p forwards, plus the steady state's one
        assert simulate(schedule).peak_activations == \
            [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]


@pytest.mark.parametrize("p", range(2, 9))
def test_any_number_of_microbatches_validates(p):
    """Any m in p..4p, not only multiples of p, in micro-batch groups of any size g in p..m
    (Megatron's microbatch_group_size_per_vp_stage; the last group takes the remainder): every
    rank's program passes the NCCL replay, and holds its warm-up plus one micro-batch,
    2 (p - r - 1) + (v - 1) G + 1 with G the largest group."""
    for v in (2, 3):
        for m in range(p, 4 * p + 1):
            for g in sorted({p, (p + m) // 2, m}):
                schedule = make_schedule("interleaved_1f1b", p, m, stages_per_rank=v,
                                         recompute=m % 2 == 1, group_size=g)
                validate_schedule(schedule)
                largest = g + m % g if m >= 2 * g else m if m % g else g
                assert simulate(schedule).peak_activations == \
                    [min(2 * (p - r - 1) + (v - 1) * largest + 1, m * v) for r in range(p)]


@pytest.mark.parametrize("p,m", [(2, 3), (4, 5), (4, 7), (4, 9), (4, 13), (8, 9)])
def test_microbatches_not_a_multiple_of_the_ranks_keep_the_bubble(p, m):
    """Each rank idles 1F1B's (p - 1)(f + b), halved by the two chunks."""
    result = simulate(interleaved(p, m, 2), CostModel(forward=1.0, backward=2.0))
    assert result.idle_per_stage == pytest.approx([(p - 1) * 3.0 / 2] * p)


def test_bad_group_sizes_are_rejected():
    for g in (3, 9):
        with pytest.raises(ValueError, match="group size must lie in"):
            make_schedule("interleaved_1f1b", 4, 8, stages_per_rank=2, group_size=g)


def test_programs_are_the_virtual_stages_merged():
    schedule = interleaved(2, 4, 2)
    assert (schedule.num_ranks, schedule.stages_per_rank, schedule.num_stages) == (2, 2, 4)
    assert [schedule.rank_of(k) for k in range(4)] == [0, 1, 0, 1]
    assert schedule.stages_of(0) == [0, 2] and schedule.stages_of(1) == [1, 3]
    last = schedule.stage_actions(3)
    assert [(a.kind, a.microbatch_id) for a in last[:3]] == \
        [(K.LOAD, 0), (K.RECV_ACT, 0), (K.FORWARD, 0)]
    assert (last[1].peer, last[1].peer_stage) == (0, 2)  # from rank 0's second chunk
    assert not any(a.kind is K.SEND_ACT for a in last)  # the last stage computes the loss
    sends = [a for a in schedule.stage_actions(1) if a.kind is K.SEND_ACT]
    # rank 1's first chunk sends to rank 0's second
    assert sends and all((a.peer, a.peer_stage) == (0, 2) for a in sends)
    for rank, program in enumerate(schedule.programs):
        tail = [a for a in program if a.stage_id is None]  # the step tail, once, last
        assert tail == list(program[-3:]) == [Action(K.REDUCE_TIED_GRADS),
                                              Action(K.REDUCE_GRADS),
                                              Action(K.OPTIMIZER_STEP)]
        assert {a.stage_id for a in program if a.stage_id is not None} == {rank, rank + 2}
    assert "forward[0]@2" in schedule.format()


@pytest.mark.parametrize("p,m,v,match", [(4, 3, 2, "at least as many micro-batches"),
                                         (4, 8, 1, "use 1f1b"), (2, 4, 0, ">= 2"),
                                         (0, 4, 2, "num_stages"),
                                         (1, 4, 2, ">= 2 pipeline ranks")])
def test_bad_sizes_are_rejected(p, m, v, match):
    with pytest.raises(ValueError, match=match):
        interleaved(p, m, v)


def test_other_schedules_run_one_stage_per_rank():
    with pytest.raises(ValueError, match="needs interleaved_1f1b"):
        make_schedule("1f1b", 2, 4, stages_per_rank=2)


def _edit(schedule: Schedule, rank: int, program) -> Schedule:
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return dataclasses.replace(schedule, programs=tuple(programs))


def _find(program, kind: ActionKind, stage_id: int, microbatch_id: int) -> int:
    return next(i for i, a in enumerate(program) if (a.kind, a.stage_id, a.microbatch_id)
                == (kind, stage_id, microbatch_id))


def test_broken_programs_are_rejected():
    schedule = interleaved(2, 2, 2)
    validate_schedule(schedule)
    program = list(schedule.programs[0])
    # rank 0 waits for its second chunk's gradient before running its first chunk's forwards
    grad = _find(program, K.RECV_GRAD, 2, 0)
    first = dataclasses.replace(program[grad], group=-1)  # a group of its own, posted first
    deadlocked = [first] + program[:grad] + program[grad + 1:]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(_edit(schedule, 0, deadlocked))
    foreign = list(program)
    foreign[_find(program, K.FORWARD, 0, 0)] = Action(K.FORWARD, 1, 0)
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        validate_schedule(_edit(schedule, 0, foreign))
    with pytest.raises(ScheduleError, match="step tail"):
        validate_schedule(_edit(schedule, 0, program[-1:] + program[:-1]))


def test_one_rank_pair_carries_several_stage_pairs_in_one_order():
    """p=2, v=3: stages 0->1, 2->3, 4->5 all go rank 0 -> 1 (and 1->2, 3->4 rank 1 -> 0).
    NCCL ignores tags, so both sides must post the messages of a rank pair in the same order:
    the validator's replay pairs them in posting order and the schedule passes; swapping two
    sends to one peer within a group would swap tensors, and is rejected."""
    p, v, m = 2, 3, 4
    schedule = interleaved(p, m, v)
    validate_schedule(schedule)
    for src, dst in ((0, 1), (1, 0)):
        sent = [a.message for a in schedule.programs[src]
                if a.kind in (K.SEND_ACT, K.SEND_GRAD) and a.peer == dst]
        received = [a.message for a in schedule.programs[dst]
                    if a.kind in (K.RECV_ACT, K.RECV_GRAD) and a.peer == src]
        assert sent == received and len(set(sent)) == len(sent)
        assert {(s, d) for _, s, d, _ in sent} == \
            {e for e in schedule.edges if e[0] % p == src or e[1] % p == src}
    program = list(schedule.programs[0])
    for _, actions in schedule.groups(0):  # the first group sending twice to rank 1
        sends = [a for a in actions if a.kind in (K.SEND_ACT, K.SEND_GRAD)]
        if len(sends) >= 2:
            break
    i, j = program.index(sends[0]), program.index(sends[1])
    program[i], program[j] = program[j], program[i]
    with pytest.raises(ScheduleError, match="NCCL would pair them"):
        validate_schedule(_edit(schedule, 0, program))


def test_recomputation_adds_reruns_to_the_chunks_that_checkpoint():
    flags = [True, False, True, False]
    schedule = interleaved(2, 2, 2, recompute=flags)
    validate_schedule(schedule)
    assert [any(a.kind is K.RECOMPUTE for a in schedule.stage_actions(s))
            for s in range(4)] == flags
    costs = CostModel(forward=1.0, backward=2.0, recompute=1.0)
    assert simulate(schedule, costs).makespan > simulate(interleaved(2, 2, 2), costs).makespan


# -- stage-aware recomputation over a rank's several stages (synthetic memory profile) ------------
# 2 ranks x 2 chunks = 4 stages of 4 blocks: each block keeps 10 bytes, its input 1; 4 bytes
# outside the blocks, and `head` more on the last stage
def kept_bytes(head: int) -> list[KeptBytes]:
    return [KeptBytes(tuple(44 + (head if s == 3 else 0) - 9 * k for k in range(5)))
            for s in range(4)]


KEPT = kept_bytes(40)


def test_stage_aware_ratios_with_two_stages_per_rank():
    m = 8
    ratios = stage_aware_ratios("interleaved_1f1b", 2, m, KEPT, 0.5)
    peaks = predict_peaks("interleaved_1f1b", 2, m, KEPT, ratios)
    assert len(ratios) == 4 and len(peaks) == 2  # per stage, per rank
    assert ratios[0] == ratios[2] == 0.5  # the first rank's stages, as given
    assert peaks[1] <= peaks[0]
    for s in (1, 3):  # rank 1's stages recompute the least that keeps it within rank 0's peak
        if ratios[s] > 0:
            fewer = list(ratios)
            fewer[s] -= 0.25
            assert predict_peaks("interleaved_1f1b", 2, m, KEPT, fewer)[1] > peaks[0]
    everything = predict_peaks("interleaved_1f1b", 2, m, KEPT, [1.0] * 4)
    nothing = predict_peaks("interleaved_1f1b", 2, m, KEPT, [0.0] * 4)
    assert all(lo < p < hi for lo, p, hi in zip(everything, peaks, nothing)), \
        (everything, peaks, nothing)
    assert ratios == [0.5, 0.5, 0.5, 0.0]
    # a head outweighing rank 0's in-flight micro-batches: rank 1 recomputes all it can
    heavy = kept_bytes(200)
    ratios = stage_aware_ratios("interleaved_1f1b", 2, m, heavy, 0.5)
    assert ratios == [0.5, 1.0, 0.5, 1.0]
    peaks = predict_peaks("interleaved_1f1b", 2, m, heavy, ratios)
    assert peaks[1] > peaks[0]


def test_budget_mode_with_two_stages_per_rank():
    m = 8
    everything = predict_peaks("interleaved_1f1b", 2, m, KEPT, [1.0] * 4)
    nothing = predict_peaks("interleaved_1f1b", 2, m, KEPT, [0.0] * 4)
    budget = [(lo + hi) / 2 for lo, hi in zip(everything, nothing)]
    ratios = choose_ratios("interleaved_1f1b", 2, m, KEPT, budget)
    peaks = predict_peaks("interleaved_1f1b", 2, m, KEPT, ratios)
    assert all(p <= b for p, b in zip(peaks, budget)), (peaks, budget)
    assert 0 < sum(ratios) < 4, ratios
    for s in range(4):  # the earlier stage of a rank settles first: one block fewer breaks it
        if ratios[s] > 0 and all(r == 1.0 for r in ratios[s + 2::2]):
            fewer = list(ratios)
            fewer[s] -= 0.25
            assert predict_peaks("interleaved_1f1b", 2, m, KEPT, fewer)[s % 2] > budget[s % 2]
    with pytest.raises(ValueError, match="stage 0 needs .* above its budget"):
        choose_ratios("interleaved_1f1b", 2, m, KEPT, [everything[0] - 1, everything[1]])


ARGS = ["simulate", "--stages", "4", "--microbatches", "8", "--json"]


def test_cli_interleave(tmp_path, capsys):
    out = subprocess.run([sys.executable, "-m", "merak", *ARGS, "--schedule", "interleaved_1f1b",
                          "--interleave", "2"], capture_output=True, text=True, check=True).stdout
    one = json.loads(out)
    assert one["idle"] == pytest.approx([4.5] * 4) and one["makespan"] == pytest.approx(28.5)
    assert one["peak_activations"] == [11, 9, 7, 5]
    assert cli_main([*ARGS, "--interleave", "2", "--compare", str(tmp_path)]) == 0
    every = json.loads(capsys.readouterr().out)
    assert every["interleaved_1f1b"] == one and every["1f1b"]["idle"] == [9.0] * 4
    assert (tmp_path / "interleaved_1f1b.png").stat().st_size > 1000
    assert cli_main([*ARGS, "--schedule", "interleaved_1f1b", "--interleave", "2",
                     "--microbatches", "3"]) == 2
    assert "at least as many micro-batches" in capsys.readouterr().err


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)])
def test_runtime_parity(launches, world_size, scenario):
    figures = scenario_result(*launches(world_size), scenario)
    assert assert_like_reference(figures, rtol=RTOL, atol=ATOL,
                                 grad_atol_of_max=GRAD_ATOL_OF_MAX) > 0
    for rank, ours in enumerate(figures):
        assert ours.get("params_without_grad", []) == [], \
            f"rank {rank}: parameters without gradient {ours['params_without_grad']}"
        if "variant" in ours:  # a training run: the engine the variant asked for
            _engine_as_asked(f"rank {rank}", ours)


def _engine_as_asked(where: str, ours: dict) -> None:
    """The schedule, this rank's stages (round-robin, or a V), the stages that recompute and
    what stage-aware ratios promise (the first rank's stages at FIRST_RATIO, every other rank
    within the first rank's predicted peak or recomputing all it can, some stage free)."""
    variant, pp, rank = ours["variant"], ours["pp"], ours["pp_rank"]
    assert ours["schedule"] == VARIANTS[variant][0].get("schedule", "interleaved_1f1b"), \
        f"{where}: {variant} ran {ours['schedule']}"
    expected = ([rank, 2 * pp - 1 - rank] if variant.startswith(V_SCHEDULES)
                else list(range(rank, pp * CHUNKS, pp)))
    assert ours["runners"] == expected, f"{where}: stages {ours['runners']}, not {expected}"
    aware = ours["stage_aware"]
    if aware is None:
        recomputing = ours["runners"] if "recompute" in variant else []
    else:
        ratios, peaks, stages = aware["ratios"], aware["peaks"], pp * CHUNKS
        assert aware["kept_blocks"] == [2] * stages, f"{where}: {aware}"
        assert all(ratios[s] == FIRST_RATIO for s in range(0, stages, pp)), f"{where}: {ratios}"
        for other in range(1, pp):
            assert peaks[other] <= peaks[0] or \
                all(ratios[s] == 1.0 for s in range(other, stages, pp)), \
                f"{where}: rank {other} peaks above the first: {ratios}, {peaks}"
        assert any(r == 0 for r in ratios), f"{where}: every stage recomputes: {ratios}"
        assert aware["segment_blocks"] == [2 * r for r in ratios], f"{where}: {aware}"
        recomputing = [s for s in ours["runners"] if ratios[s] > 0]
    assert ours["recomputing"] == recomputing, \
        f"{where}: {variant} recomputes stages {ours['recomputing']}, not {recomputing}"
