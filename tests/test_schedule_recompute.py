"""Recomputation as an action, Merak's 1F1B variants, zero bubble and stage-aware recomputation:
schedules as data, the simulator's time and memory model and the CLI, in one process; the same
schedules trained in real pipelines (workers/schedule_parity.py, pp 2 and 4: their losses,
gradients and final weights compared here with the single-process model's)."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref

import pytest
import torch
from dist_harness import assert_like_reference, scenario_result
from hf_models import CustomMLP, batch
from schedule_parity import VARIANTS, scenario_names

from merak import ActionKind, CostModel, Schedule, ScheduleError, make_schedule, simulate
from merak.cli import main
from merak.recompute.blocks import BlockRecomputation, recomputed_blocks
from merak.recompute.meter import ActivationMeter
from merak.recompute.stage_aware import KeptBytes, choose_ratios, predict_peaks, stage_aware_ratios
from merak.runtime.split_backward import backward_input, backward_weight
from merak.schedule.simulator import MemoryModel
from merak.schedule.validate import validate_schedule

K = ActionKind
MERAK = ("pre_recompute_1f1b", "last_no_recompute_1f1b", "shifted_critical_path")
WORKER = "schedule_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)
# losses and final weights: torch.testing.assert_close(ours, reference, rtol=RTOL, atol=ATOL);
# gradients with atol + GRAD_ATOL_OF_MAX x the reference gradient's largest entry
RTOL, ATOL, GRAD_ATOL_OF_MAX = 1e-4, 1e-5, 1e-4


def _training(scenario: str) -> bool:
    return scenario.split("-", 2)[2] in VARIANTS


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in WORLD_SIZES
                                                 for s in scenario_names(w) if _training(s)])
def test_every_schedule_trains_like_the_single_process_model(launches, world_size, scenario):
    figures = scenario_result(*launches(world_size), scenario)
    assert assert_like_reference(figures, rtol=RTOL, atol=ATOL,
                                 grad_atol_of_max=GRAD_ATOL_OF_MAX) > 0
    variant = scenario.split("-", 2)[2]
    # all-block recomputation: every stage but the last recomputes (1f1b-recompute's own
    # program may leave it out)
    must_recompute = VARIANTS[variant].get("recompute_ratio") == 1.0 and \
        variant != "1f1b-recompute"
    for rank, ours in enumerate(figures):
        assert ours["params_without_grad"] == [], f"rank {rank}: parameters without gradient"
        if must_recompute and not ours["last_stage"]:
            assert ours["recomputes"], f"{variant}: stage {rank} never recomputes"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage_aware_and_budgeted_recomputation_in_a_real_pipeline(launches, world_size):
    """Each stage's measured peak activation bytes over a 1F1B step within 10% of the
    simulator's prediction; stage-aware: no stage above the first, ratios falling; budgeted:
    budgets met, with some recomputation (not all)."""
    pp = world_size
    for rank, seen in enumerate(scenario_result(*launches(world_size),
                                                f"llama-pp{pp}-stage-aware-memory")):
        for mode in ("stage-aware", "budget"):
            ratios, measured = seen[mode]["ratios"], seen[mode]["measured"]
            for s, (actual, expected) in enumerate(zip(measured, seen[mode]["predicted"])):
                assert abs(actual - expected) <= 0.1 * expected, \
                    f"rank {rank}, {mode}: stage {s} measured {actual} bytes, " \
                    f"predicted {expected:.0f}"
            if mode == "stage-aware":
                assert max(measured[1:]) <= measured[0], \
                    f"rank {rank}: a stage peaks above the first: {measured}"
                assert ratios[-1] < ratios[0] and ratios == sorted(ratios, reverse=True), \
                    f"rank {rank}: ratios do not fall: {ratios}"
            else:
                assert all(a <= b * 1.1 for a, b in zip(measured, seen["budget_bytes"])), \
                    f"rank {rank}: over budget: {measured} > {seen['budget_bytes']}"
                assert 0 < sum(ratios) < pp, \
                    f"rank {rank}: the budget should need some recomputation: {ratios}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dealloc_outputs_frees_each_sent_activation(launches, world_size):
    """dealloc_outputs: over a 1F1B step each stage but the last keeps at least one
    micro-batch's sent activation less at its peak; the last stage, which sends nothing, the
    same, its loss unchanged."""
    for rank, seen in enumerate(scenario_result(*launches(world_size),
                                                f"llama-pp{world_size}-dealloc-memory")):
        if seen["last_stage"]:
            assert not seen["freeable_on"] and seen["peak_on"] == seen["peak_off"], \
                f"rank {rank} (last): {seen}"
            assert seen["loss_on"] == seen["loss_off"], f"rank {rank}: the loss changed: {seen}"
        else:
            assert seen["freeable_on"] and not seen["freeable_off"], f"rank {rank}: {seen}"
            assert seen["peak_off"] - seen["peak_on"] >= seen["hidden"], \
                f"rank {rank}: less than one sent activation freed at the peak: {seen}"


def _at(actions, kind: ActionKind, microbatch_id: int) -> int:
    """Index of the `kind` action of micro-batch `microbatch_id` in `actions`."""
    return next(i for i, a in enumerate(actions)
                if a.kind is kind and a.microbatch_id == microbatch_id)


def _swapped(schedule: Schedule, rank: int, i: int, j: int) -> Schedule:
    """`schedule` with actions `i` and `j` of rank `rank`'s program swapped."""
    program = list(schedule.programs[rank])
    program[i], program[j] = program[j], program[i]
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return dataclasses.replace(schedule, programs=tuple(programs))


@pytest.mark.parametrize("name", [*MERAK, "zero_bubble", "1f1b", "ds_default"])
def test_every_size_validates_within_1f1b_memory(name):
    for p in range(1, 7):
        for m in range(1, 13):
            recompute = name in MERAK or (p + m) % 2 == 0  # with and without recomputation
            schedule = make_schedule(name, p, m, recompute=recompute)
            report = validate_schedule(schedule)
            assert (report.num_ranks, report.num_microbatches) == (p, m)
            peaks = simulate(schedule).peak_activations
            one_f = [min(p - s, m) for s in range(p)]
            if name == "zero_bubble":  # ZB-H1: weight gradients wait, within 1F1B's peak
                assert max(peaks) == max(one_f)
            elif name != "ds_default":
                assert peaks == one_f
            else:  # GPipe holds every micro-batch
                assert peaks == [m] * p


def test_merak_orderings_in_the_simulator():
    """4 stages, 8 micro-batches, forward 1, backward 2, recomputation 1."""
    costs = CostModel(forward=1, backward=2, recompute=1)
    span = {name: simulate(make_schedule(name, 4, 8, recompute=True), costs).makespan
            for name in ("1f1b", *MERAK)}
    assert span["1f1b"] > span["pre_recompute_1f1b"] > span["shifted_critical_path"]
    assert span["1f1b"] > span["last_no_recompute_1f1b"] > span["shifted_critical_path"]
    assert span == {"1f1b": 44, "pre_recompute_1f1b": 41, "last_no_recompute_1f1b": 42,
                    "shifted_critical_path": 39}


def test_zero_bubble_idles_a_third_of_1f1b():
    costs = CostModel(forward=1, backward=2, weight_grad=1)  # F = input grad = weight grad
    one_f = simulate(make_schedule("1f1b", 4, 8), costs).idle_per_stage
    zero = simulate(make_schedule("zero_bubble", 4, 8), costs).idle_per_stage
    assert sum(zero) <= sum(one_f) / 3
    assert zero == [3.0] * 4 and one_f == [9.0] * 4


def test_recomputation_places_and_the_memory_model():
    pre = make_schedule("pre_recompute_1f1b", 3, 4, recompute=True)
    stage0 = pre.stage_actions(0)
    assert _at(stage0, K.RECOMPUTE, 0) < _at(stage0, K.RECV_GRAD, 0)
    last = make_schedule("last_no_recompute_1f1b", 3, 4, recompute=True)
    assert not any(a.kind is K.RECOMPUTE for a in last.stage_actions(2))
    assert all(any(a.kind is K.RECOMPUTE for a in last.stage_actions(s)) for s in (0, 1))
    plain = make_schedule("1f1b", 3, 4, recompute=True)
    stage1 = plain.stage_actions(1)
    assert _at(stage1, K.RECV_GRAD, 0) < _at(stage1, K.RECOMPUTE, 0)
    result = simulate(plain, memory=MemoryModel(full=8.0, kept=2.0))
    # stage s: one micro-batch whole (recomputed for its backward), the others kept
    assert result.peak_memory == [8 + 2 * 2, 8 + 2 * 1, 8.0]
    with pytest.raises(ValueError, match="activation_checkpointing=True"):
        make_schedule("shifted_critical_path", 3, 4)


def test_orders_of_the_new_actions_are_checked():
    schedule = make_schedule("1f1b", 2, 2, recompute=True)
    validate_schedule(schedule)
    program = schedule.programs[0]
    swapped = _swapped(schedule, 0, _at(program, K.RECOMPUTE, 0), _at(program, K.BACKWARD, 0))
    with pytest.raises(ScheduleError, match="stage 0: micro-batch 0: backward .* recompute"):
        validate_schedule(swapped)
    zb = make_schedule("zero_bubble", 2, 2)
    validate_schedule(zb)
    program = zb.programs[1]
    swapped = _swapped(zb, 1, _at(program, K.BACKWARD_INPUT, 0),
                       _at(program, K.BACKWARD_WEIGHT, 0))
    with pytest.raises(ScheduleError, match="stage 1: micro-batch 0: backward_weight"):
        validate_schedule(swapped)


def test_cli_json_and_compare(tmp_path, capsys):
    # in process (test_schedule_programs runs it as a command)
    def _simulate_cli(*args: str) -> str:
        assert main(["simulate", "--stages", "4", "--microbatches", "8", *args]) == 0
        return capsys.readouterr().out

    one = json.loads(_simulate_cli("--recompute-cost", "1", "--json"))
    assert one["makespan"] == 44 and one["peak_activations"] == [4, 3, 2, 1]
    assert one["peak_memory"] == [1.75, 1.5, 1.25, 1.0]  # kept memory: a quarter by default
    zb = json.loads(_simulate_cli("--schedule", "zero_bubble", "--weight-grad-cost", "1",
                                  "--json"))
    assert zb["idle"] == [3.0] * 4
    out = _simulate_cli("--recompute-cost", "1", "--compare", str(tmp_path))
    for name in ("1f1b", *MERAK, "zero_bubble"):
        assert name in out and (tmp_path / f"{name}.png").stat().st_size > 1000
    table = json.loads(_simulate_cli("--recompute-cost", "1", "--compare", str(tmp_path),
                                     "--json", "--forward-cost", "1,1,1,2"))
    assert table["shifted_critical_path"]["makespan"] < table["1f1b"]["makespan"]


# -- stage-aware recomputation on a synthetic memory profile --------------------------------------
# 4 stages of 4 blocks: each block keeps 10 bytes, its input 1; 4 more bytes outside the blocks
KEPT = [KeptBytes(tuple(44 - 9 * k for k in range(5)))] * 4


def test_stage_aware_ratios_fall_with_the_stage():
    ratios = stage_aware_ratios("1f1b", 4, 8, KEPT, 1.0)
    peaks = predict_peaks("1f1b", 4, 8, KEPT, ratios)
    assert ratios[0] == 1.0 and ratios == sorted(ratios, reverse=True) and ratios[-1] == 0.0
    assert max(peaks[1:]) <= peaks[0]
    # each later stage recomputes the least it can: one block fewer would exceed the first
    for s in range(1, 3):
        fewer = list(ratios)
        fewer[s] -= 0.25
        assert predict_peaks("1f1b", 4, 8, KEPT, fewer)[s] > peaks[0]


def test_budget_mode_picks_the_least_recomputation_or_says_why_not():
    ratios = choose_ratios("1f1b", 4, 8, KEPT, [100.0] * 4)
    assert all(p <= 100 for p in predict_peaks("1f1b", 4, 8, KEPT, ratios))
    assert ratios == [0.75, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="stage 0 needs .* above its budget"):
        choose_ratios("1f1b", 4, 8, KEPT, [40.0] * 4)


# -- block recomputation in one process -----------------------------------------------------------
def test_recomputed_blocks_give_the_same_gradients_and_demand_their_rerun():
    torch.manual_seed(0)
    model = CustomMLP(depth=5)
    data = batch("mlp", 0, 4)
    model(**data).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert recomputed_blocks(5, 0.8, 3) == [[0, 1, 2], [3]]
    recompute = BlockRecomputation(list(model.blocks), [[0, 1, 2], [3]], torch.device("cpu"))
    try:
        recompute.begin_forward(0)
        loss = model(**data)
        recompute.end_forward()
        with pytest.raises(RuntimeError, match="was not recomputed"):
            loss.backward(retain_graph=True)
        model.zero_grad()
        recompute.recompute(0)
        loss.backward()
    finally:
        recompute.remove()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
    assert "forward" not in vars(model.blocks[0])  # the block's own forward is back


def test_a_released_micro_batch_leaves_nothing_alive_without_gc():
    """The rerun's saved tensors must not keep its graph (a cycle through autograd's C++ nodes
    that gc cannot collect leaked the whole stage once per dry run)."""
    torch.manual_seed(0)
    model = CustomMLP(depth=3)
    data = batch("mlp", 0, 4)
    recompute = BlockRecomputation(list(model.blocks), [[0, 1, 2]], torch.device("cpu"))
    gc.disable()
    try:
        recompute.begin_forward(0)
        loss = model(**data)
        recompute.end_forward()
        recompute.recompute(0)
        kept = [weakref.ref(t) for call in recompute._records[0].calls for t in call.saved
                if not isinstance(t, torch.nn.Parameter)]
        assert kept
        loss.backward()
        del loss
        recompute.release(0)
        alive = [r for r in kept if r() is not None]
    finally:
        gc.enable()
        recompute.remove()
    assert not alive, f"{len(alive)} of {len(kept)} recomputed tensors outlive their backward"


def test_the_activation_meter_frees_a_split_backward_through_a_softmax():
    """A zero-bubble backward (input half, then weight half) of a stage ending in
    cross-entropy: log_softmax saves its own output, which the meter's wrapper must not tie
    back to the node (that cycle outlived the step, and gc, on every last stage)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 32)
    weights = list(head.parameters())
    meter = ActivationMeter(weights)
    gc.disable()
    try:
        for _ in range(2):
            x = torch.randn(8, 16, requires_grad=True)
            with meter.recording():
                loss = torch.nn.functional.cross_entropy(head(x), torch.arange(8))
            assert meter.live > 0
            _, pending = backward_input([loss], [None], [x], weights)
            backward_weight(pending, weights)
            del pending, loss, x
            assert meter.live == 0, f"{meter.live} bytes still held after the weight half"
    finally:
        gc.enable()
