"""MerakTrainer with expert parallelism (pooled worker ep_trainer.py): a Qwen3-MoE and a Mixtral
written by `save_pretrained` and loaded under `init_empty_weights`, trained (both at dp2 ep2 on 2
ranks; the Qwen3-MoE also at dp2 ep2 pp2, dp2 ep2 tp2 and, trained only, dp2 ep2 tp2 with
sequence parallelism (and TP overlap level 1 with MERAK_TEST_MATRIX=full) and dp4 ep4 (one
expert a rank) on 4; dp4 ep4 pp2 on 8 with MERAK_TEST_MATRIX=full) on padded rows of varying
length, against single-process HF Trainer on the same directory and rows: every step's loss
and gradient norm (load-balancing loss included), the `save_model` directory (the Hub's layout,
every expert) against HF's trained model, `merak export` of the last checkpoint against
`save_model`, each rank holding 1/ep of every experts tensor (1/(ep x tp) at tp2: each expert split
over tp too), and the checkpoint of step 2 resumed in another layout (dp2 ep1; dp4 ep2 pp1 under
ZeRO-1; dp4 ep2 tp1 from tp2; dp2 ep2 pp2 under ZeRO-1 from dp4 ep4; dp4 ep2 pp2 under ZeRO-1 from
dp4 ep4 pp2) continuing the same curve
(and at the same dp evaluating to the same loss). DeepSeek-V3 (sigmoid routing limited to one of
two groups, a shared expert, its first layer dense), OLMoE and GPT-OSS (expert biases, its own
router), loaded the same way, at dp2 ep2, and with MERAK_TEST_MATRIX=full these three and Mixtral
at dp2 ep2 pp2, dp2 ep2 tp2 (and, but GPT-OSS, with sequence parallelism) and dp4 ep4 pp2 (8
ranks, one expert a rank): every step's loss and gradient norm. In every run each rank holds
1/ep of each experts tensor of its stage and read
exactly 1/ep of their bytes from the files. On 4 ranks, ``auto_parallel`` from
``merak.init(ep=2)``: the plan it writes chooses an ep2 layout, which trains at HF Trainer's loss
and gradient norm with 1/ep of each experts tensor per rank. fp16 loss scaling at dp2 ep2 pp2
(ep_fp16.py) against HF Trainer's fp16 path, an inf in one rank's expert gradient skipped
everywhere. In one process: the rules refusing
what ep does not combine with yet, before any build."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import scenario_result
from ep_trainer import (
    AUTO,
    MICRO_BATCH,
    OVERLAP_RUN,
    PLANNED,
    RUNS,
    SAVE_STEP,
    SEQ,
    SFT_RUNS,
    hub_tensors,
    reference,
    sft_reference,
)

import merak
from merak.rules import Choices, NotSupportedYetError, refusal

WORKER = "ep_trainer.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = tuple(RUNS)
# fp32; the saved weights after 4 AdamW steps at lr 1e-2 (the root of small second moments
# magnifies rounding)
LOSS_ATOL, NORM_RTOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-4
# at tp2: 1.07e-4 at one element of layers.1.self_attn.o_proj whose updates nearly cancel (it
# moved 1.7e-3 in 4 steps), the same at dp2 tp2 ep1: the TP all-reduce's rounding, not ep's
WEIGHT_ATOL_TP = 2e-4
# the families whose tensor-parallel plan splits each expert's intermediate dim over tp
# (moe_tp_experts); GPT-OSS's inferred plan keeps its experts whole on the tp ranks
EXPERTS_SPLIT_BY_TP = ("qwen3_moe", "mixtral", "deepseek_v3", "olmoe")


def _check_experts_held_and_read(figures: list[dict], scenario: str) -> None:
    """Each rank holds 1/ep of each experts tensor of its stage (1/(ep x tp) where the family's
    TP plan splits every expert too) and read exactly 1/ep of their bytes from the hub's files
    (all of them where an inferred TP plan is proven on whole experts), nothing twice."""
    family = scenario.split("-")[1]
    for rank, ours in enumerate(figures):
        held = ours["held"]  # (gate_up_proj, down_proj[, their biases]) x the rank's MoE layers
        layers = 1 if "pp2" in scenario else 2  # of 2, a stage each at pp2
        if family == "deepseek_v3":  # its first layer dense: on the first stage at pp2
            layers -= 1 if ours["pp_rank"] == 0 else 0
        assert len(held) == layers * (4 if family == "gpt_oss" else 2), (rank, held)
        split = ours["ep"] * (ours["tp"] if family in EXPERTS_SPLIT_BY_TP else 1)
        assert all(mine * split == whole for mine, whole in held.values()), (rank, held)
        reads = ours["reads"]
        assert (reads["stage_experts"] > 0) == (layers > 0) and not reads["twice"], reads
        # (GPT-OSS at tp2: its inferred TP plan is proven on whole experts, read whole)
        whole = family not in EXPERTS_SPLIT_BY_TP and ours["tp"] > 1
        assert reads["experts"] * (1 if whole else ours["ep"]) == reads["stage_experts"], \
            (rank, reads)


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in RUNS for s in RUNS[w]
                                                 if RUNS[w][s][2] is None])
def test_merak_trainer_with_expert_parallelism_trains_more_families_like_hf(
        launches, world_size, scenario, tmp_path):
    """DeepSeek-V3, OLMoE and GPT-OSS (and, with MERAK_TEST_MATRIX=full, Mixtral at the
    layouts it does not save and resume at): every step's loss and gradient norm."""
    figures = scenario_result(*launches(world_size), scenario)
    theirs, _, _ = reference(Path(figures[0]["hub"]), tmp_path, whole=False)
    for rank, ours in enumerate(figures):
        assert ours["curve"]["loss"] == pytest.approx(theirs["loss"], abs=LOSS_ATOL), rank
        assert ours["curve"]["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=NORM_RTOL)
        if scenario.endswith("-sp"):  # the residual stream split over tp, each MoE layer whole:
            # its router saw the micro-batch's full sequences on every rank
            assert ours["sequence_parallel_blocks"] == 2, (rank, ours)
            assert ours["routed_rows"] == [MICRO_BATCH * SEQ], (rank, ours["routed_rows"])
        if scenario == OVERLAP_RUN:  # q, k, v and o_proj of both layers sub-pipelined
            assert ours["overlapped_layers"] == 8, (rank, ours)
    _check_experts_held_and_read(figures, scenario)
    _print_gaps(scenario, figures, theirs)


def _print_gaps(scenario: str, figures: list[dict], theirs: dict, more: str = "") -> None:
    loss_gap = max(abs(a - b) for f in figures for a, b in zip(f["curve"]["loss"], theirs["loss"]))
    norm_gap = max(abs(a - b) / abs(b) for f in figures
                   for a, b in zip(f["curve"]["grad_norm"], theirs["grad_norm"]))
    print(f"{scenario}: loss {loss_gap:.2g}, grad norm {norm_gap:.2g} relative{more}")


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in RUNS for s in RUNS[w]
                                                 if RUNS[w][s][2] is not None])
def test_merak_trainer_with_expert_parallelism_trains_saves_and_resumes_like_hf(
        launches, world_size, scenario, tmp_path):
    figures = scenario_result(*launches(world_size), scenario)
    first = figures[0]
    _, trained_layout, resumed_layout = RUNS[world_size][scenario][:3]
    assert first["optimizers"] == ["ExpertZero1" if layout[3] == 1 and layout[2] > 1 else "AdamW"
                                   for layout in (trained_layout, resumed_layout)], first
    theirs, _, trained = reference(Path(first["hub"]), tmp_path)
    for rank, ours in enumerate(figures):
        assert ours["curve"]["loss"] == pytest.approx(theirs["loss"], abs=LOSS_ATOL), rank
        assert ours["curve"]["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=NORM_RTOL)
        # the resumed run continues the curve: steps after the checkpoint's, in another ep
        resumed = ours["resumed"]
        assert resumed["loss"][SAVE_STEP:] == pytest.approx(ours["curve"]["loss"][SAVE_STEP:],
                                                            abs=LOSS_ATOL), rank
        assert resumed["grad_norm"][SAVE_STEP:] == pytest.approx(
            ours["curve"]["grad_norm"][SAVE_STEP:], rel=NORM_RTOL)
        if ours["dps"][0] == ours["dps"][1]:  # (eval adds each dp rank's load-balancing loss)
            assert ours["resumed_eval_loss"] == pytest.approx(ours["eval_loss"], abs=LOSS_ATOL)
    dp, _, ep, zero, _ = trained_layout  # ZeRO-2/3: experts over edp, the rest over dp
    assert all(f["zero_groups"] == ({"dense": [dp], "experts": [dp // ep]} if zero >= 2 else
                                    {"dense": [], "experts": []}) for f in figures), figures
    assert first["same_export"], "merak export of the last checkpoint differs from save_model"
    saved = hub_tensors(Path(first["saved"]))
    assert sorted(saved) == sorted(trained), sorted(set(saved) ^ set(trained))[:8]
    assert any(".experts.3." in n or "experts.gate_up_proj" in n for n in saved), sorted(saved)
    worst = max((saved[n] - t).abs().max().item() for n, t in trained.items())
    assert worst < (WEIGHT_ATOL_TP if trained_layout[4] > 1 else WEIGHT_ATOL), worst
    _check_experts_held_and_read(figures, scenario)
    _print_gaps(scenario, figures, theirs, f", saved weights {worst:.2g} from HF Trainer's")


@pytest.mark.parametrize("world_size", [2])
def test_merak_trainer_applies_a_planned_layout_with_expert_parallelism(launches, world_size,
                                                                        tmp_path):
    """A plan file (as `merak plan` or auto_parallel writes it) choosing dp2 ep2 for a job
    made at dp2 ep1: the trainer re-initializes at ep2, each rank holds half of every experts
    tensor, and every step's loss and gradient norm are HF Trainer's."""
    figures = scenario_result(*launches(world_size), PLANNED)
    theirs, _, _ = reference(Path(figures[0]["hub"]), tmp_path, whole=False)
    for rank, ours in enumerate(figures):
        assert ours["layout"] == [2, 2, 1, 1], (rank, ours["layout"])
        assert len(ours["held"]) == 4 and all(mine * 2 == whole
                                              for mine, whole in ours["held"]), ours["held"]
        assert ours["curve"]["loss"] == pytest.approx(theirs["loss"], abs=LOSS_ATOL), rank
        assert ours["curve"]["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=NORM_RTOL)
    _print_gaps(PLANNED, figures, theirs)


@pytest.mark.parametrize("world_size", [4])
def test_merak_trainer_plans_a_layout_with_expert_parallelism_and_trains_like_hf(
        launches, world_size, tmp_path):
    """``MerakTrainer(auto_parallel=True)`` on 4 ranks from ``merak.init(ep=2)``: the planner
    ranks only ep2 layouts, dry-runs the best predicted and keeps it, as plan.json records;
    the trainer re-initializes at it, each rank holds 1/ep of every experts tensor of its
    stage (1/(ep x tp) at tp2) and every step's loss and gradient norm are single-process HF
    Trainer's at the chosen micro-batch size."""
    from merak.strategy.candidate import Candidate

    figures = scenario_result(*launches(world_size), AUTO)
    plan = figures[0]["plan"]
    chosen = Candidate(**plan["chosen"])
    assert chosen.ep == 2 and chosen.dp % 2 == 0, chosen
    assert chosen.dp * chosen.tp * chosen.pp == world_size, chosen
    assert plan["ranked"] and all(p["ep"] == 2 for p in plan["ranked"]), plan["ranked"][:3]
    # its one dry run (plan_dry_runs=1): the best predicted, measured and kept
    assert list(plan["measured"]) == [plan["ranked"][0]["label"]] == [chosen.label], plan
    theirs, _, _ = reference(Path(figures[0]["hub"]), tmp_path, whole=False,
                             micro_batch=chosen.micro_batch)
    for rank, ours in enumerate(figures):
        layout = ours["layout"]
        assert (layout["dp"], layout["ep"], layout["tp"], layout["pp"], layout["micro_batch"],
                layout["microbatches"]) == (chosen.dp, chosen.ep, chosen.tp, chosen.pp,
                                            chosen.micro_batch, chosen.microbatches), rank
        layers = 2 // chosen.pp  # (gate_up_proj, down_proj) of each MoE layer of the stage
        assert len(ours["held"]) == 2 * layers, (rank, ours["held"])
        assert all(mine * chosen.ep * chosen.tp == whole for mine, whole in ours["held"]), \
            (rank, ours["held"])
        assert ours["curve"]["loss"] == pytest.approx(theirs["loss"], abs=LOSS_ATOL), rank
        assert ours["curve"]["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=NORM_RTOL)
    _print_gaps(AUTO, figures, theirs, f"; chosen {chosen.label}")


# fp16 autocast: measured 6e-7 and 8.6e-6 from HF Trainer's fp16 path; the same HF run in fp32
# is 2.8e-5 (loss) and 8.7e-5 (grad norm) from it at step 1, 1.4e-4 and 1.2e-3 at step 2
FP16_LOSS_ATOL, FP16_NORM_RTOL = 1e-5, 5e-5


@pytest.mark.parametrize("world_size", [4])
def test_fp16_loss_scaling_with_expert_parallelism_skips_an_expert_overflow_everywhere(
        launches, world_size, tmp_path):
    """fp16 with dynamic loss scaling at dp2 ep2 pp2 against single-process HF Trainer on
    accelerate's fp16 path (float16 autocast, torch's GradScaler): every step's loss and finite
    gradient norm. An inf in one rank's expert gradient at step 3 (its edp group is itself, so
    only the scaler's world-wide check reaches the others): every rank skips that step (its
    parameters unchanged) and halves the scale, as HF's GradScaler does, and step 4 trains."""
    from ep_fp16 import FP16_RUN, POISONED_STEP, POWER
    from ep_fp16 import reference as fp16_reference

    figures = scenario_result(*launches(world_size), FP16_RUN)
    theirs = fp16_reference(Path(figures[0]["hub"]), tmp_path)
    scales = [2.0 ** POWER] * (POISONED_STEP - 1) + [2.0 ** (POWER - 1)] * 2
    assert theirs["scales"] == scales and theirs["changed"] == [True, True, False, True], theirs
    assert [f["poisoned"] for f in figures].count(True) == 1, figures
    finite = [i for i in range(4) if i != POISONED_STEP - 1]
    for rank, ours in enumerate(figures):
        assert ours["edp_size"] == 1, (rank, ours["edp_size"])
        assert ours["scales"] == ours["logged_scales"] == scales, (rank, ours)
        assert ours["changed"] == theirs["changed"], (rank, ours["changed"])
        assert ours["skipped_steps"] == [0, 0, 1, 1], (rank, ours["skipped_steps"])
        assert ours["curve"]["loss"] == pytest.approx(theirs["curve"]["loss"],
                                                      abs=FP16_LOSS_ATOL), rank
        assert [ours["curve"]["grad_norm"][i] for i in finite] == pytest.approx(
            [theirs["curve"]["grad_norm"][i] for i in finite], rel=FP16_NORM_RTOL), rank
        # the skipped step leaves the learning-rate schedule alone (step 4 runs at step 3's
        # rate; the reference, accelerate's fp16 path forced on CPU, logs the next rate there)
        rates = ours["curve"]["learning_rate"]
        assert rates[:3] == pytest.approx(theirs["curve"]["learning_rate"][:3]), (rank, rates)
        assert rates[3] == rates[2], (rank, rates)
    loss_gap = max(abs(a - b) for f in figures
                   for a, b in zip(f["curve"]["loss"], theirs["curve"]["loss"]))
    norm_gap = max(abs(f["curve"]["grad_norm"][i] / theirs["curve"]["grad_norm"][i] - 1)
                   for f in figures for i in finite)
    print(f"{FP16_RUN}: loss {loss_gap:.2g}, grad norm {norm_gap:.2g} relative (steps "
          f"{[i + 1 for i in finite]}), scales {scales}")


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("scenario", list(SFT_RUNS))
def test_trl_sft_trainer_with_expert_parallelism_matches_single_process_sft(world_size, launches,
                                                                            scenario, tmp_path):
    """``class MerakSFTTrainer(MerakTrainer, SFTTrainer)`` at dp2 ep2 against plain
    SFTTrainer in one process: every step's loss, gradient norm, entropy, token accuracy and
    token count, on both ranks, and greedy generation after training (each dp rank decodes
    one prompt, in lockstep over the ep group) against HF `generate`; each rank holds half of
    every experts tensor."""
    import sft_common as sft

    figures = scenario_result(*launches(world_size), scenario)
    theirs = sft_reference(SFT_RUNS[scenario], tmp_path)
    assert len(theirs["loss"]) == sft.STEPS and theirs["mean_token_accuracy"][-1] > 0.05
    for rank, ours in enumerate(figures):
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (rank, key)
        assert ours["num_tokens"] == theirs["num_tokens"], rank
        assert ours["generated"] == theirs["generated"], rank  # greedy, in lockstep over ep
        assert len(ours["held"]) == 4 and all(mine * 2 == whole for mine, whole in
                                              ours["held"].values()), ours["held"]
    gaps = {key: max(abs(a - b) / max(abs(b), 1e-12) for f in figures
                     for a, b in zip(f[key], theirs[key])) for key in ("loss", "grad_norm")}
    print(f"{scenario}: loss {gaps['loss']:.2g}, grad norm {gaps['grad_norm']:.2g} relative")


@pytest.mark.parametrize("fields,match", [
    ({"tp": 2, "tp_overlapping_level": 2}, "tp_overlapping_level=2 with expert parallelism"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size=True with expert parallelism"),
])
def test_the_rules_refuse_what_expert_parallelism_does_not_combine_with_yet(fields, match):
    found = refusal(Choices(ep=2, **fields))
    assert found is not None and isinstance(found.error(), NotSupportedYetError)
    with pytest.raises(NotSupportedYetError, match=match):
        raise found.error()
    assert refusal(Choices(ep=1, **fields)) is None or "expert" not in refusal(
        Choices(ep=1, **fields)).message


def test_merak_arguments_read_ep_from_the_last_init(monkeypatch):
    """Made after merak.init(ep=2): what ep does not combine with is refused at once, before
    any build; every ZeRO stage is accepted."""
    import merak.rules as rules_module

    monkeypatch.setattr(rules_module, "default_context",
                        lambda: type("Ctx", (), {"cp": 1, "tp": 1, "ep": 2})())
    with pytest.raises(NotSupportedYetError, match="auto_find_batch_size=True with expert"):
        merak.MerakArguments(output_dir="out", use_cpu=True, report_to="none",
                             auto_find_batch_size=True)
    for zero in (1, 2, 3):
        merak.MerakArguments(output_dir="out", use_cpu=True, report_to="none", zero_stage=zero)


def test_the_rules_accept_tensor_and_expert_parallelism_together():
    assert refusal(Choices(ep=2, tp=2)) is None
    for zero in (1, 2, 3):
        assert refusal(Choices(ep=2, tp=2, zero_stage=zero)) is None
    assert refusal(Choices(ep=2, tp=1, sequence_parallel=True)) is None  # (no tp: nothing split)
    # the MoE layers run whole on every tp rank's sequences (trainer-qwen3_moe-dp2-ep2-tp2-sp)
    assert refusal(Choices(ep=2, tp=2, sequence_parallel=True)) is None
    # level 1 sub-pipelines the attention's TP layers; each MoE layer runs once per micro-batch
    # (trainer-qwen3_moe-dp2-ep2-tp2-overlap1, MERAK_TEST_MATRIX=full)
    assert refusal(Choices(ep=2, tp=2, tp_overlapping_level=1)) is None
    assert refusal(Choices(ep=2, text_generation=True)) is None  # (decoded in lockstep)


def test_a_scheduler_state_fits_another_number_of_parameter_groups():
    """ZeRO-2/3 with ep gives the experts' mesh parameter groups of its own (HF's
    create_optimizer): a scheduler saved with 2 groups resumes with 3 and back, when every
    group has the same schedule; different schedules are refused by name."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    from merak.checkpoint.files import CheckpointError
    from merak.trainer.checkpointing import scheduler_state_for

    def scheduler(groups: int, rates=None):
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
        optimizer = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in
                                     zip(params, rates or [0.1] * groups)], lr=0.1)
        return optimizer, get_linear_schedule_with_warmup(optimizer, 0, 10)

    _, saved = scheduler(2)
    for _ in range(3):
        saved.optimizer.step()
        saved.step()
    optimizer, resumed = scheduler(3)
    resumed.load_state_dict(scheduler_state_for(saved.state_dict(), 3))
    assert resumed.get_last_lr() == pytest.approx([saved.get_last_lr()[0]] * 3)
    assert resumed.last_epoch == 3
    resumed.step()
    saved.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.1 * 6 / 10] * 3)
    assert scheduler_state_for(resumed.state_dict(), 2)["_last_lr"] == saved.get_last_lr()
    _, different = scheduler(2, [0.1, 0.2])
    with pytest.raises(CheckpointError, match="2 parameter groups with different base_lrs"):
        scheduler_state_for(different.state_dict(), 3)
