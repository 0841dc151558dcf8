"""TRL's DPOTrainer with precomputed reference log-probabilities: the preference
rows, fields and layouts shared by MerakDPOTrainer's runs (workers/trainer_subclasses.py) and
the single-process DPOTrainer reference (test_dpo.py).

ROWS prompt/chosen/rejected rows of varying length from examples/data's sentences: the prompt
is a sentence's first words, chosen the rest of it, rejected the rest of a sentence further on.
A step is 2 micro-batches of GLOBAL_MICRO_BATCH prompts (each collated as chosen rows then
rejected rows), 5 steps: one epoch and a step of the next."""

from __future__ import annotations

import os

import sft_common as sft

ROWS, STEPS, MICROBATCHES, GLOBAL_MICRO_BATCH = 32, 5, 2, 4
FIELDS = {**sft.FIELDS, "max_steps": STEPS, "max_length": 48, "beta": 0.1,
          "precompute_ref_log_probs": True}
LAYOUTS = {"dpo-dp1tp2pp2": (1, 2, 2), "dpo-dp2tp1pp2": (2, 1, 2)}
LORA_TARGETS = "all-linear"
# name -> (layout, LoRA through DPOTrainer's peft_config (the reference: the model with its
# adapters off), DPOConfig fields over FIELDS, policy loaded from a saved directory)
VARIANTS = {
    "dpo-lora-dp1tp2pp2": ((1, 2, 2), True, {}, False),
    "dpo-lora-dp2tp1pp2": ((2, 1, 2), True, {}, False),
    # DPOConfig's defaults: TRL's reference is a frozen copy loaded from the policy's path
    "dpo-defaults-dp1tp2pp2": ((1, 2, 2), False, {"precompute_ref_log_probs": False}, True),
    "dpo-defaults-dp2tp1pp2": ((2, 1, 2), False, {"precompute_ref_log_probs": False}, True),
    "dpo-lora-per-step-dp2tp1pp2": ((2, 1, 2), True, {"precompute_ref_log_probs": False},
                                    False),
    "dpo-ipo-dp1tp2pp2": ((1, 2, 2), False, {"loss_type": ["ipo"]}, False),
    "dpo-ipo-dp2tp1pp2": ((2, 1, 2), False, {"loss_type": ["ipo"]}, False)}
# evaluate() after training on EVAL_ROWS held-out rows (3 steps of GLOBAL_MICRO_BATCH): name ->
# as VARIANTS
EVAL_ROWS = 12
EVALUATED = {
    "dpo-eval-dp1tp2pp2": ((1, 2, 2), False, {}, False),
    "dpo-eval-lora-defaults-dp2tp1pp2": ((2, 1, 2), True, {"precompute_ref_log_probs": False},
                                         False)}
# sync_ref_model under ZeRO (dp2 pp2): ZeRO-3 in the suite (its forwards gather over the dp
# ranks), ZeRO-2 too with MERAK_TEST_MATRIX=full
ZERO_STAGES = (2, 3) if os.environ.get("MERAK_TEST_MATRIX") == "full" else (3,)
# an explicit ref_model (a second model: the policy's architecture, other weights, as an SFT'd
# checkpoint), loaded with from_pretrained inside init_empty_weights: its frozen replica split as
# the policy's runs the pass before training; with sync_ref_model it runs before every step and
# follows the policy (mixed after steps 2 and 4). name -> as VARIANTS
REFERENCED = {
    "dpo-refmodel-dp1tp2pp2": ((1, 2, 2), False, {"precompute_ref_log_probs": False}, False),
    "dpo-sync-dp1tp2pp2": ((1, 2, 2), False, {"precompute_ref_log_probs": False,
                                              "sync_ref_model": True, "ref_model_sync_steps": 2,
                                              "ref_model_mixup_alpha": 0.5}, False),
    # ZeRO-2 / ZeRO-3 (FSDP2 over dp): the replica sharded as the policy, mixed shard by shard
    **{f"dpo-sync-zero{z}-dp2tp1pp2": ((2, 1, 2), False, {
        "precompute_ref_log_probs": False, "sync_ref_model": True, "ref_model_sync_steps": 2,
        "ref_model_mixup_alpha": 0.5, "zero_stage": z}, False) for z in ZERO_STAGES}}
# auto_parallel (from 4 data-parallel ranks): the trainer plans with its reference mode
# (sync_ref_model: "replica", its forwards in every step and its weights on every rank) and trains
# the chosen layout; about 45 s (the planner measures 4 micro-batch sizes), so with
# MERAK_TEST_MATRIX=full only. name -> as VARIANTS (no layout: the plan's)
PLANNED = {"dpo-sync-auto": (None, False, {
    "precompute_ref_log_probs": False, "sync_ref_model": True, "ref_model_sync_steps": 2,
    "ref_model_mixup_alpha": 0.5, "auto_parallel": True, "plan_dry_runs": 1}, False)} \
    if os.environ.get("MERAK_TEST_MATRIX") == "full" else {}
# fields of MerakArguments only: the single process has none
MERAK_ONLY = ("zero_stage", "auto_parallel", "plan_dry_runs")
LOGGED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
          "rewards/margins", "logps/chosen", "logps/rejected")


def dataset(order: list[int] | None = None, first: int = 0, rows: int = ROWS):
    """`rows` preference rows from the sentences from `first` on (in `order`)."""
    import datasets

    sentences = [s for s in sft.texts() if len(s.split()) >= 4]
    prompts, chosen, rejected = [], [], []
    for i in range(first, first + rows):
        words = sentences[i].split()
        cut = max(2, len(words) // 3)
        other = sentences[(i + 7) % len(sentences)].split()
        prompts.append(" ".join(words[:cut]))
        chosen.append(" " + " ".join(words[cut:]))
        rejected.append(" " + " ".join(other[len(other) // 2:]))
    order = list(order or range(rows))
    return datasets.Dataset.from_dict({"prompt": [prompts[i] for i in order],
                                       "chosen": [chosen[i] for i in order],
                                       "rejected": [rejected[i] for i in order]})


def reference_order(dp: int) -> list[int]:
    """As `sft.reference_order`: a single process's micro-batch i holds every dp rank's
    micro-batch i, dp rank by dp rank."""
    return sft.reference_order(dp, ROWS)


def policy(pretrained: str | None = None):
    """The policy: `sft.model`, or loaded from `pretrained` (where `save_policy` wrote it)."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(pretrained) if pretrained else sft.model()


def save_policy(directory) -> str:
    sft.model().save_pretrained(directory)
    return str(directory)


def save_reference(directory) -> str:
    """The explicit reference: the policy's architecture with every weight moved by a seeded
    0.05 x N(0, 1) (a checkpoint fine-tuned away from the policy's initial weights)."""
    import torch

    model = sft.model()
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(directory)
    return str(directory)


def eval_dataset():
    """EVAL_ROWS held-out preference rows (the sentences after the training rows')."""
    return dataset(first=ROWS, rows=EVAL_ROWS)


def single_process(lora: bool = False, pretrained: str | None = None, evaluate: bool = False,
                   reference: str | None = None, **fields) -> dict:
    """Plain single-process DPOTrainer on the rows in `reference_order` (with `lora`, LoRA
    adapters through its peft_config; `fields` over FIELDS; the policy loaded from
    `pretrained`; the ref_model loaded from `reference`): what it logs (with `evaluate`, and
    what evaluate() returns after training, under "eval")."""
    import transformers as tf
    import trl

    fields = {k: v for k, v in fields.items() if k not in MERAK_ONLY}
    trainer = trl.DPOTrainer(
        model=policy(pretrained), processing_class=sft.tokenizer(),
        ref_model=tf.AutoModelForCausalLM.from_pretrained(reference) if reference else None,
        train_dataset=dataset(reference_order(2)),
        eval_dataset=eval_dataset() if evaluate else None,
        peft_config=sft.peft_config(LORA_TARGETS) if lora else None,
        args=trl.DPOConfig(output_dir="out", per_device_train_batch_size=GLOBAL_MICRO_BATCH,
                           per_device_eval_batch_size=GLOBAL_MICRO_BATCH,
                           **{**FIELDS, **fields}))
    trainer.train()
    figures = logged(trainer.state.log_history)
    if evaluate:
        figures["eval"] = evaluated(trainer.evaluate())
    return figures


def evaluated(metrics: dict) -> dict[str, float]:
    """evaluate()'s loss and DPO's metrics (not its timings)."""
    return {k: v for k, v in metrics.items()
            if not k.endswith(("_runtime", "_per_second", "epoch"))}


def logged(log_history: list[dict]) -> dict[str, list[float]]:
    steps = [h for h in log_history if "loss" in h and "train_runtime" not in h]
    return {key: [h[key] for h in steps] for key in LOGGED}


def evaluation_gaps(scenario: str, theirs: dict[str, float], mine: dict[str, float],
                    loose_of: dict[str, float]) -> dict[str, float]:
    """Each metric single-process `evaluate()` logged (`theirs`) against the pipeline's
    (`mine`): within 1e-5 relative, or the absolute bound of the first `loose_of` prefix the
    key starts with (else 1e-7); printed, and returned as relative gaps. For the test bodies of
    test_dpo and test_kto (the workers do not compare)."""
    import pytest

    assert set(theirs) <= set(mine) and "eval_loss" in theirs, (sorted(theirs), sorted(mine))
    gaps = {}
    for key, value in theirs.items():
        loose = next((v for k, v in loose_of.items() if key.startswith(k)), 1e-7)
        assert mine[key] == pytest.approx(value, rel=1e-5, abs=loose), key
        gaps[key] = abs(mine[key] - value) / max(abs(value), 1e-12)
    print(f"{scenario}: merak {mine} reference {theirs}")
    print(f"{scenario} largest relative gaps: "
          + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))
    return gaps
