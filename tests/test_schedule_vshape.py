"""The V schedules as data: ZB-V and DualPipeV (2 stages per rank placed in a V, the turn
handed off locally) and interleaved 1F1B for any number of micro-batches. Every program
`merak simulate --programs` prints passes the NCCL replay; the simulator's bubble and memory;
the tools that read the registry (stage-aware recomputation, the strategy search) take them.
Their training runs at parity are in test_interleaved (the engine, workers/interleaved_parity.py)
and test_trainer_matrix (MerakTrainer against HF Trainer, Llama and a Mixtral)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import transformers as tf

from merak import ActionKind, CostModel, MerakArguments, make_schedule, simulate
from merak.cli import main as cli_main
from merak.recompute.stage_aware import KeptBytes, predict_peaks, stage_aware_ratios
from merak.schedule.actions import COMPUTE_KINDS, P2P_KINDS, Schedule, v_shape
from merak.schedule.errors import ScheduleError
from merak.schedule.simulator import MemoryModel
from merak.schedule.validate import validate_schedule
from merak.strategy.cluster import cluster
from merak.strategy.costs import analytic_costs
from merak.strategy.search import search
from merak.strategy.shape import ModelShape

K = ActionKind
V_SCHEDULES = ("zbv", "dualpipev")
# f = b_input = b_weight = 1 per rank (a V's chunk takes half of each)
EQUAL = CostModel(forward=1.0, backward=2.0, weight_grad=1.0)


def v(name: str, p: int, m: int, recompute=False) -> Schedule:
    return make_schedule(name, p, m, stages_per_rank=2, recompute=recompute)


def test_the_v_placement_and_the_local_hand_off_at_its_turn():
    schedule = v("zbv", 4, 8)
    assert schedule.placement == v_shape(4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert [schedule.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for rank, program in enumerate(schedule.programs):
        for a in program:
            if a.kind in P2P_KINDS:  # only rank 3's stages 3 -> 4 hand off, outside groups
                assert (a.peer == rank) == (a.group is None) == (rank == 3 and a.stage_id in
                                                                  (3, 4) and a.peer_stage in (3, 4))
    turn = [str(a) for a in schedule.programs[3] if a.local and a.microbatch_id == 0]
    assert turn == ["send_act[0]@3->4", "recv_act[0]@4<-3", "send_grad[0]@4->3",
                    "recv_grad[0]@3<-4"]
    program = list(schedule.programs[3])  # taken before it is handed over: rejected
    i, j = (program.index(next(a for a in program if str(a) == t)) for t in turn[:2])
    program[i], program[j] = program[j], program[i]
    broken = Schedule(schedule.name, 4, 2, 8, (*schedule.programs[:3], tuple(program)),
                      schedule.edges, schedule.placement)
    with pytest.raises(ScheduleError, match="before it is handed over"):
        validate_schedule(broken)


@pytest.mark.parametrize("name", [*V_SCHEDULES, "interleaved_1f1b"])
def test_every_printed_program_passes_the_nccl_replay(name):
    """`merak simulate --programs` for p in 2..8 and m in p..4p (for interleaved 1F1B: m not a
    multiple of p too): what it prints, read back, passes the replay (one ordered stream per
    rank, rendezvous sends, messages paired in posting order)."""
    replayed = 0
    for p in range(2, 9):
        for m in range(p, 4 * p + 1):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert cli_main(["simulate", "--schedule", name, "--stages", str(p),
                                 "--microbatches", str(m), "--programs"]) == 0
            printed = Schedule.from_json(json.loads(out.getvalue()))
            assert (printed.num_ranks, printed.num_microbatches) == (p, m)
            validate_schedule(printed)
            replayed += 1
    print(f"\n{name}: {replayed} programs replayed")
    assert replayed == sum(3 * p + 1 for p in range(2, 9)) == 112


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_every_size_with_recomputation_validates(name):
    for p in range(1, 9):
        for m in range(1, 4 * p + 1, 3):
            schedule = v(name, p, m, recompute=[s % 2 == 0 for s in range(2 * p)])
            validate_schedule(schedule)
            recomputed = {a.stage_id for prog in schedule.programs for a in prog
                          if a.kind is K.RECOMPUTE}
            assert recomputed == set(range(0, 2 * p, 2))


def test_zbv_idles_only_the_fill_and_holds_1f1b_memory():
    """p = 4, m = 16, f = b_input = b_weight = 1: 1F1B idles 3 (p - 1) = 9 per rank; ZB-V only
    the fill, (p - 1) chunk forwards = 1.5, the least any order on a V can (rank 3 starts 1.5
    late, every rank does the same work), a 5.2-fold smaller bubble fraction. Its peak
    activations are 1F1B's (2p half-stage chunks = p stages)."""
    memory = MemoryModel(full=1.0)
    one_f = simulate(make_schedule("1f1b", 4, 16), EQUAL, memory)
    zbv = simulate(v("zbv", 4, 16), EQUAL, memory)
    print(f"\n1f1b bubble {one_f.bubble:.4f} idle {one_f.idle_per_stage}; zbv bubble "
          f"{zbv.bubble:.4f} idle {zbv.idle_per_stage}; ratio {zbv.bubble / one_f.bubble:.3f}")
    assert one_f.idle_per_stage == pytest.approx([9.0] * 4)
    assert zbv.idle_per_stage == pytest.approx([1.5] * 4) and zbv.makespan == 49.5
    assert zbv.bubble / one_f.bubble < 0.2
    assert max(zbv.peak_memory) == max(one_f.peak_memory) == 4.0
    assert zbv.peak_activations == [8] * 4  # half-stage chunks


@pytest.mark.parametrize("p", range(2, 9))
def test_zbv_bubble_stays_near_the_fill(p):
    """For m in 2p..4p the idle stays within 6 chunk forwards (3 here) of the fill (p - 1) / 2
    (the list schedule's greedy choices are not optimal everywhere: at p = 8 it idles up to 3
    beyond, against 1F1B's 21), memory at most 1F1B's."""
    for m in range(2 * p, 4 * p + 1):
        result = simulate(v("zbv", p, m), EQUAL)
        assert all((p - 1) / 2 <= idle <= (p - 1) / 2 + 3 for idle in result.idle_per_stage)
        assert max(result.peak_activations) <= 2 * p


def test_dualpipev_pairs_a_forward_with_the_other_chunks_backward():
    p, m = 4, 12
    schedule = v("dualpipev", p, m)
    for rank, program in enumerate(schedule.programs):
        compute = [(i, a) for i, a in enumerate(program) if a.kind in COMPUTE_KINDS]
        pairs = 0
        for (i, first), (j, then) in zip(compute, compute[1:]):
            between = program[i + 1:j]
            if first.kind is K.FORWARD and then.kind is K.BACKWARD_INPUT and \
                    first.stage_id != then.stage_id and not any(a.kind in P2P_KINDS
                                                                for a in between):
                pairs += 1  # adjacent, their receives before both, their sends after both
        # the steady state's 2 (m - 2p + r + 1) pairs, and step 5's p - r - 1
        assert pairs == 2 * (m - 2 * p + rank + 1) + (p - rank - 1), (rank, pairs)
    result = simulate(schedule, EQUAL, MemoryModel(full=1.0))
    assert result.bubble < simulate(make_schedule("1f1b", p, m), EQUAL).bubble / 3
    assert result.peak_activations == [2 * p + 1] * p  # DualPipe's p + 1/2 stages


def test_arguments_take_the_new_names():
    for name in V_SCHEDULES:
        assert MerakArguments(output_dir="o", train_schedule=name).train_schedule == name
        with pytest.raises(ValueError, match="num_model_chunks only applies"):
            MerakArguments(output_dir="o", train_schedule=name, num_model_chunks=3)
    with pytest.raises(ValueError, match="places 2 stages on every rank"):
        make_schedule("zbv", 2, 4, stages_per_rank=3)
    with pytest.raises(SystemExit, match="does not apply"):
        cli_main(["simulate", "--schedule", "zbv", "--stages", "2", "--microbatches", "4",
                  "--interleave", "3"])


def test_stage_aware_recomputation_fits_a_ranks_two_stages_of_the_v():
    """Rank 0 holds stages 0 and 2p-1 (the head): they take the first rank's ratio; rank 1's
    stages 1 and 2 fit within rank 0's peak."""
    kept = [KeptBytes(tuple(44 + (40 if s == 3 else 0) - 9 * k for k in range(5)))
            for s in range(4)]
    ratios = stage_aware_ratios("zbv", 2, 8, kept, 0.5)
    peaks = predict_peaks("zbv", 2, 8, kept, ratios)
    assert ratios[0] == ratios[3] == 0.5 and len(peaks) == 2
    assert peaks[1] <= peaks[0]


@pytest.mark.parametrize("name", [*V_SCHEDULES, "interleaved_1f1b"])
def test_the_strategy_planner_ranks_the_new_schedules(name):
    """Llama 3 8B on 8 H100s, 12 sequences: the planner predicts every layout of the schedule
    (interleaved 1F1B also where 12 micro-batches are no multiple of pp), with 2 stages per
    rank placed as the registry says."""
    shape = ModelShape.from_config(tf.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8))
    h100 = cluster("h100")
    costs = {1: analytic_costs(shape, h100, 1, 4096)}
    plan = search(shape, costs, h100, 12, 4096, micro_batch_sizes=(1,),
                  schedules=[name, "1f1b"], zero_stages=(0, 1))
    mine = [p for p in plan.ranked if p.candidate.schedule == name]
    assert mine and all(p.candidate.chunks == 2 and p.step_s > 0 for p in mine)
    if name == "interleaved_1f1b":
        assert any(p.candidate.microbatches % p.candidate.pp for p in mine)
    for p in mine:  # without recomputation, against 1F1B at the same layout: less pipeline time
        same = [q for q in plan.ranked if q.candidate.schedule == "1f1b" and
                q.candidate.recompute == p.candidate.recompute == "off" and
                (q.candidate.dp, q.candidate.tp, q.candidate.pp, q.candidate.zero,
                 q.candidate.sequence_parallel) == (p.candidate.dp, p.candidate.tp,
                                                    p.candidate.pp, p.candidate.zero,
                                                    p.candidate.sequence_parallel)]
        assert all(p.pipeline_s < q.pipeline_s for q in same)
