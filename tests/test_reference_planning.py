"""A preference trainer's reference forwards (TRL's DPO, KTO) as instructions of the schedule
(merak/schedule/reference.py): the validator accepts them where they run, the simulator times
them, the strategy planner's predictions (merak/strategy/reference.py) and the energy planner's
clock frontier count them, by exactly their cost where no bubble hides any of it. No process
group: the schedules and costs are data."""

from __future__ import annotations

import dataclasses

import pytest
import transformers as tf

from merak.energy.planning.frontier import ClockFrontier
from merak.energy.profiling.gpu import SyntheticGPUModel
from merak.energy.profiling.profile_data import aggregate, synthetic_profile
from merak.energy.training.session import plan_arguments
from merak.schedule.actions import ActionKind
from merak.schedule.registry import SCHEDULES, make_schedule, reference_pass
from merak.schedule.simulator import CostModel, simulate
from merak.schedule.validate import validate_schedule
from merak.strategy.candidate import Candidate
from merak.strategy.cluster import cluster
from merak.strategy.costs import analytic_costs
from merak.strategy.predict import Predictor
from merak.strategy.reference import REPLICA_BYTES_PER_PARAM, ReferenceCosts
from merak.strategy.shape import ModelShape

K = ActionKind
SMALL = SyntheticGPUModel(clock_step=90)  # 6 clocks


def _schedule(name: str, ranks: int, microbatches: int, reference: bool = False):
    info = SCHEDULES[name]
    return make_schedule(name, ranks, microbatches,
                         stages_per_rank=2 if info.several_stages_per_rank else 1,
                         recompute=info.needs_recompute, reference=reference)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_runs_the_reference_before_each_forward(name):
    plain, referenced = _schedule(name, 2, 4), _schedule(name, 2, 4, reference=True)
    validate_schedule(referenced)
    for rank, program in enumerate(referenced.programs):
        forwards = [(a.stage_id, a.microbatch_id) for a in program if a.kind is K.FORWARD]
        references = [(a.stage_id, a.microbatch_id) for a in program
                      if a.kind is K.REFERENCE_FORWARD]
        assert references == forwards and forwards  # one each, in the forwards' order
        for i, action in enumerate(program):
            if action.kind is K.FORWARD:
                before = program[i - 1]
                assert (before.kind, before.stage_id, before.microbatch_id) == \
                    (K.REFERENCE_FORWARD, action.stage_id, action.microbatch_id)
        # nothing else moved: no transfer added (both models' activations share a message)
        assert [a for a in program if a.kind is not K.REFERENCE_FORWARD] == \
            list(plain.programs[rank])
    # the simulator times them: a 0.5 reference forward makes the step longer
    costs = CostModel(forward=1.0, backward=2.0, reference=0.5)
    assert simulate(referenced, costs).makespan > simulate(plain, costs).makespan


def test_the_reference_costs_exactly_its_forwards_where_no_bubble_hides_them():
    """One pipeline rank (no bubble): m reference forwards of 0.5 add m x 0.5; the pass before
    training is a forward-only schedule of reference forwards: m x 0.5 on one rank, and through
    two ranks the forward-only pipeline's fill."""
    costs = CostModel(forward=1.0, backward=2.0, reference=0.5)
    for m in (1, 4, 7):
        plain = simulate(make_schedule("1f1b", 1, m), costs).makespan
        assert simulate(make_schedule("1f1b", 1, m, reference=True), costs).makespan == \
            pytest.approx(plain + 0.5 * m)
        one = reference_pass(1, m)
        validate_schedule(one)
        assert simulate(one, costs).makespan == pytest.approx(0.5 * m)
        two = reference_pass(2, m)
        validate_schedule(two)
        assert {a.kind for p in two.programs for a in p} >= {K.REFERENCE_FORWARD} and \
            K.FORWARD not in {a.kind for p in two.programs for a in p}
        assert simulate(two, costs).makespan == pytest.approx(0.5 * (m + 1))


def _predictor(mode: str = "none", epochs: float = 1.0, seq: int = 512) -> Predictor:
    shape = ModelShape.from_config(tf.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4))
    h100 = cluster("h100")
    costs = {m: analytic_costs(shape, h100, m, seq) for m in (1, 2)}
    return Predictor(shape, costs, h100, memory_bytes=10**15,
                     reference=ReferenceCosts(mode, epochs))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b"])
def test_the_strategy_planner_charges_the_reference(schedule):
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    one = Candidate(dp=2, tp=2, pp=1, micro_batch=1, microbatches=8)
    piped = Candidate(dp=2, tp=1, pp=2, micro_batch=2, microbatches=8, schedule=schedule,
                      chunks=chunks)
    none = _predictor()
    for c in (one, piped):
        base = none.predict(c)
        assert base.fits and base.reference_s == 0
        # the rank's reference forward: its forward's blocks and head, as the simulator sees it
        forward = none._times(c, none._rank_cost(c, none.costs[c.micro_batch]),
                              [8 // (c.pp * c.chunks)] * c.pp * c.chunks,
                              [0] * c.pp * c.chunks).reference
        # per step (LoRA's adapters off on every micro-batch): on one pipeline rank exactly
        # m reference forwards more; through a pipeline at least the busiest rank's m
        per_step = _predictor("per_step").predict(c)
        added = per_step.step_s - base.step_s
        if c.pp == 1:
            assert added == pytest.approx(c.microbatches * forward[0], rel=1e-9)
        else:
            assert c.microbatches * max(forward) * (1 - 1e-9) <= added \
                <= (c.microbatches + c.pp * c.chunks) * max(forward)
        assert per_step.state_bytes == base.state_bytes  # the adapters off: no second copy
        # before training: the pass over one step's rows, charged per step over the epochs
        for epochs in (1.0, 3.0):
            before = _predictor("before", epochs).predict(c)
            pass_s = simulate(reference_pass(c.pp, c.microbatches, stages_per_rank=c.chunks,
                                             placement=before_placement(c)),
                              CostModel(forward=1.0, reference=tuple(forward),
                                        p2p=_p2p(none, c))).makespan
            assert before.reference_s == pytest.approx(pass_s, rel=1e-12) and pass_s > 0
            assert before.step_s - base.step_s == pytest.approx(pass_s / epochs, rel=1e-9)
            if c.pp == 1:
                assert pass_s == pytest.approx(c.microbatches * forward[0], rel=1e-9)
        # a second model's replica: its step time as per_step, and its weights on every rank
        replica = _predictor("replica").predict(c)
        assert replica.step_s == pytest.approx(per_step.step_s, rel=1e-12)
        params = none._stage_params(c)
        held = [0.0] * c.pp
        for s, p in enumerate(params):
            held[before_placement(c)[s]] += REPLICA_BYTES_PER_PARAM * p
        assert [a - b for a, b in zip(replica.state_bytes, base.state_bytes)] == \
            pytest.approx(held, rel=1e-12)
        # under ZeRO-3 the replica is sharded over the replicas as the policy's weights
        sharded = dataclasses.replace(c, zero=3)
        added = [a - b for a, b in zip(_predictor("replica").predict(sharded).state_bytes,
                                       none.predict(sharded).state_bytes)]
        assert added == pytest.approx([h / c.replicas for h in held], rel=1e-12)


def test_a_dry_run_gets_the_references_predicted_share():
    """Online planning (auto_parallel) dry-runs the policy's step alone: its measured time and
    peak get what the reference adds to the candidate's prediction (merak/dryrun/online.py),
    nothing without a reference."""
    from merak.dryrun.online import _reference_share

    c = Candidate(dp=2, tp=1, pp=2, micro_batch=2, microbatches=8)
    plain = _predictor().predict(c)
    for mode, epochs in (("before", 2.0), ("replica", 1.0)):
        charged = _predictor(mode, epochs).predict(c)
        seconds, held = _reference_share(charged, _predictor())
        assert seconds == pytest.approx(charged.step_s - plain.step_s, rel=1e-12) and seconds > 0
        assert held == pytest.approx(charged.peak_bytes - plain.peak_bytes, rel=1e-12)
        assert (held > 0) == (mode == "replica")  # the pass before training holds no copy
    assert _reference_share(plain, None) == (0.0, 0.0)


def before_placement(c: Candidate):
    from merak.schedule.registry import placement_of

    return placement_of(c.schedule, c.pp, c.chunks)


def _p2p(predictor: Predictor, c: Candidate) -> float:
    cost = predictor.costs[c.micro_batch]
    return predictor.cluster.p2p_s(cost.boundary_bytes, c.pp, c.replicas * c.tp)


def test_a_bad_reference_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="reference mode must be one of.*'replica'.*got 'x'"):
        ReferenceCosts("x")
    with pytest.raises(ValueError, match="epochs must be positive"):
        ReferenceCosts("before", 0)


def _frontier(schedule) -> ClockFrontier:
    profiles, p2p = aggregate(synthetic_profile(SMALL, schedule.num_ranks,
                                                chunks=schedule.stages_per_rank))
    return ClockFrontier(schedule, profiles, p2p)


def test_the_energy_planner_sets_a_clock_for_every_reference_forward():
    """The clock plan covers the reference's instructions: the all-max iteration time and
    energy grow by what they take (on one pipeline rank exactly m reference forwards' time and
    energy: nothing idles), every rank's frequency schedule names them in program order, and
    the planner's own check of its times against the simulator holds."""
    for ranks in (1, 2):
        plain = _frontier(make_schedule("1f1b", ranks, 4))
        referenced = _frontier(make_schedule("1f1b", ranks, 4, reference=True))
        t0, e0 = plain.evaluate(plain.max_clock_plan())
        t1, e1 = referenced.evaluate(referenced.max_clock_plan())
        top = SMALL.max_clock
        if ranks == 1:
            assert t1 - t0 == pytest.approx(4 * SMALL.time("reference_forward", 0, 1, top))
            assert e1 - e0 == pytest.approx(4 * SMALL.energy("reference_forward", 0, 1, top))
        else:
            assert t1 > t0 and e1 > e0
        plan = referenced.max_clock_plan()
        assert referenced.simulated(plan) == pytest.approx(t1)
        for rank, entry in enumerate(referenced.schedules(plan)):
            names = [name for name, _ in entry["frequencies"]]
            assert names.count("reference_forward") == 4
            assert names == [a.name for a in referenced.schedule.compute_actions(rank)]
    # the pass before training plans as its own forward-only schedule
    before = _frontier(reference_pass(2, 4))
    names = {a.name for r in range(2) for a in before.schedule.compute_actions(r)}
    assert names == {"reference_forward"}
    assert before.evaluate(before.max_clock_plan())[0] > 0


def test_plan_arguments_name_the_reference():
    schedule = make_schedule("1f1b", 2, 4, reference=True)
    args = plan_arguments(schedule)
    assert args[args.index("--reference") + 1] == "per_step"
    assert "--reference" not in plan_arguments(make_schedule("1f1b", 2, 4))


def test_the_energy_plan_command_plans_the_pass_before_training(tmp_path):
    import json

    from merak.energy.cli import main
    from merak.energy.profiling.profile_data import write_profile

    # (one call: each draws its frontier picture; `--reference per_step` builds the schedule
    # plan_arguments names, whose frontier test_the_energy_planner_... checks)
    profile = write_profile(synthetic_profile(SMALL, 2), tmp_path / "p.csv")
    out = tmp_path / "before.json"
    assert main(["plan", str(profile), "--stages", "2", "--microbatches", "4",
                 "--reference", "before", "--max-slowdown", "0.05", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert len(plan["schedules"]) == 2
    for entry in plan["schedules"]:  # the pass: 4 reference forwards per rank, nothing else
        assert [name for name, _ in entry["frequencies"]] == ["reference_forward"] * 4


def test_merak_plan_charges_the_reference_pass(tmp_path):
    """`merak plan --reference before` (offline): every ranked candidate carries its pass, and
    its predicted step is the plain one plus the pass over the epochs."""
    import json

    from merak.cli import main as merak_main

    config_dir = tmp_path / "tiny"
    tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2).save_pretrained(config_dir)
    plans = {}
    for mode in ("none", "before"):
        out = tmp_path / f"{mode}.json"
        assert merak_main(["plan", "--model", str(config_dir), "--cluster", "h100",
                           "--world-size", "4", "--global-batch", "8", "--seq-len", "64",
                           "--micro-batch-sizes", "1,2", "--no-sequence-parallel",
                           "--no-context-parallel", "--reference", mode, "--epochs", "2",
                           "--out", str(out)]) == 0
        plans[mode] = {p["label"]: p for p in json.loads(out.read_text())["ranked"]}
    both = set(plans["none"]) & set(plans["before"])
    assert both
    for label in both:
        plain, before = plans["none"][label], plans["before"][label]
        assert plain["reference_s"] == 0 and before["reference_s"] > 0
        assert before["step_s"] == pytest.approx(plain["step_s"] + before["reference_s"] / 2,
                                                 rel=1e-9)


def test_the_interpreter_refuses_a_step_that_runs_the_reference_by_name():
    """The planners count reference forwards inside a step; the runtime does not run them
    there yet (sync_ref_model runs the replica's pass before each step instead)."""
    from torch import nn

    from merak.runtime.program import training_schedule
    from merak.stages.split import Piece, manual_split

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)

    split = manual_split(Two(), [Piece("a", ["x"], ["h"]), Piece("b", ["h"], ["loss"])],
                         num_stages=2)
    training_schedule("1f1b", split, 2, 1, 4, 0.0)  # the plain step is accepted
    with pytest.raises(ValueError, match="reference model's forwards in the step.*does not "
                                         "run them yet"):
        training_schedule(make_schedule("1f1b", 2, 4, reference=True), split, 2, 1, 4, 0.0)
