"""Interleaved 1F1B: the schedule as data (generation, validation, simulation, CLI), and the
runtime on CPU/gloo against the single-process model (workers/interleaved_parity.py: one
torchrun launch per world size, pp 2 and 4, 2 chunks per rank, Llama and GPT-2, 3 steps)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_harness import cached_launcher, check
from interleaved_parity import scenario_names

from merak import Action, ActionKind, CostModel, ScheduleError, make_schedule, simulate
from merak.cli import main as cli_main
from merak.pipeline.interleaved import (
    InterleavedSchedule,
    interleaved_1f1b,
    simulate_interleaved,
    validate_interleaved,
)

K = ActionKind
WORLD_SIZES = (2, 4)


def test_bubble_is_half_of_1f1b_with_two_chunks():
    costs = CostModel(forward=1.0, backward=2.0)
    one_f = simulate(make_schedule("1f1b", 4, 8), costs)
    inter = simulate_interleaved(interleaved_1f1b(4, 8, 2), costs)
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
    result = simulate_interleaved(interleaved_1f1b(p, m, v), CostModel(forward=1.0, backward=2.0))
    assert result.idle_per_stage == pytest.approx([(p - 1) * 3.0 / v] * p)


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("v", [2, 3, 4])
def test_every_size_validates(p, v):
    for m in range(p, 4 * p + 1, p):
        report = validate_interleaved(interleaved_1f1b(p, m, v))
        # Megatron's warm-up, 2 (p - r - 1) + (v - 1) p forwards, plus the steady state's one
        assert report.peak_activations == [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
                                           for r in range(p)]


def test_programs_are_the_virtual_stages_merged():
    schedule = interleaved_1f1b(2, 4, 2)
    assert schedule.num_stages == 4
    virtual = schedule.virtual
    assert [schedule.rank_of(k) for k in range(4)] == [0, 1, 0, 1]
    assert virtual[3][:3] == [Action(K.LOAD, 0), Action(K.RECV_ACT, 0), Action(K.FORWARD, 0)]
    assert Action(K.SEND_ACT, 0) not in virtual[3]  # the last virtual stage computes the loss
    assert Action(K.SEND_ACT, 0) in virtual[1]  # rank 1's first chunk sends to rank 0's second
    for rank, program in enumerate(schedule.programs):
        assert [a for s, a in program if s is None] == virtual[0][-3:]  # the tail, once
        assert {s for s, _ in program if s is not None} == {rank, rank + 2}
    assert "forward[0]@2" in schedule.format()


@pytest.mark.parametrize("p,m,v,match", [(4, 6, 2, "multiple of the pipeline ranks"),
                                         (4, 8, 1, "use 1f1b"), (2, 4, 0, ">= 2"),
                                         (0, 4, 2, "num_stages")])
def test_bad_sizes_are_rejected(p, m, v, match):
    with pytest.raises(ValueError, match=match):
        interleaved_1f1b(p, m, v)


def _edit(schedule: InterleavedSchedule, rank: int, program) -> InterleavedSchedule:
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return InterleavedSchedule(schedule.num_ranks, schedule.num_chunks,
                               schedule.num_microbatches, tuple(programs))


def test_broken_programs_are_rejected():
    schedule = interleaved_1f1b(2, 2, 2)
    program = list(schedule.programs[0])
    # rank 0 waits for its second chunk's gradient before running its first chunk's forwards
    first_forward = program.index((0, Action(K.FORWARD, 0)))
    grad = program.index((2, Action(K.RECV_GRAD, 0)))
    deadlocked = [program[grad]] + program[:grad] + program[grad + 1:]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_interleaved(_edit(schedule, 0, deadlocked))
    foreign = list(program)
    foreign[first_forward] = (1, Action(K.FORWARD, 0))
    with pytest.raises(ScheduleError, match="other ranks"):
        validate_interleaved(_edit(schedule, 0, foreign))
    with pytest.raises(ScheduleError, match="step tail"):
        validate_interleaved(_edit(schedule, 0, program[-1:] + program[:-1]))


def test_recomputation_adds_reruns_to_the_chunks_that_checkpoint():
    flags = [True, False, True, False]
    schedule = interleaved_1f1b(2, 2, 2, recompute=flags)
    validate_interleaved(schedule)
    assert [any(a.kind is K.RECOMPUTE for a in actions) for actions in schedule.virtual] == flags
    costs = CostModel(forward=1.0, backward=2.0, recompute=1.0)
    assert simulate_interleaved(schedule, costs).makespan > \
        simulate_interleaved(interleaved_1f1b(2, 2, 2), costs).makespan


def test_tags_tell_apart_the_virtual_stage_pairs_of_one_rank_pair():
    """p=2, v=3: stages 0->1, 2->3, 4->5 all go rank 0 -> 1 (and 1->2, 3->4 rank 1 -> 0)."""
    from types import SimpleNamespace

    from torch import nn

    from merak import Piece, manual_split
    from merak.pipeline.interleaved_runtime import VirtualStageComm, VirtualStageContext

    p, v, m = 2, 3, 4
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(p * v)])
    pieces = [Piece(str(i), ["x"], ["x"]) for i in range(p * v)]
    split = manual_split(model, pieces, num_stages=p * v, output="x")
    base = SimpleNamespace(pp=p, rank_of=lambda pp_rank, dp_rank=None, tp_rank=None: pp_rank)
    comms = [VirtualStageComm(VirtualStageContext(base, k, v), split, k, 10.0)
             for k in range(p * v)]
    seen: dict[tuple[int, int, int], tuple] = {}  # (src rank, dst rank, tag) -> message
    for k, comm in enumerate(comms):
        for peer in (k - 1, k + 1):
            if not 0 <= peer < p * v:
                continue
            assert comm.ctx.stage_rank(peer) == peer % p
            is_grad = peer < k  # gradients go upstream
            for mb in range(m):
                tag = comm.tag(peer, mb, is_grad, 0)
                # the receiver computes the same tag for the same message
                assert comms[peer].tag(k, mb, is_grad, 0) == tag
                key = (k % p, peer % p, tag)
                assert key not in seen, (key, seen.get(key), (k, peer, mb))
                seen[key] = (k, peer, mb)
            meta = (k % p, peer % p, comm.meta_tag(peer))
            assert meta not in seen
            seen[meta] = (k, peer)


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
    with pytest.raises(SystemExit, match="multiple of the pipeline ranks"):
        cli_main([*ARGS, "--schedule", "interleaved_1f1b", "--interleave", "2",
                  "--microbatches", "6"])


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return cached_launcher("interleaved_parity.py", tmp_path_factory)


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)])
def test_runtime_parity(launches, world_size, scenario):
    results, output = launches(world_size)
    check(results, output, scenario)
