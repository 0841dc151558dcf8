"""TRL's KTOTrainer: the unpaired preference rows, fields and runs shared by MerakKTOTrainer's
runs (workers/trainer_subclasses.py) and the single-process KTOTrainer reference (test_kto.py).

ROWS prompt/completion/label rows from dpo_common's preference rows: row i's completion is its
chosen one when desirable (label True: two rows in three) and its rejected one otherwise. KTO
pairs each row's prompt with the previous row's completion (within each micro-batch) to
estimate its KL term. A step is 2 micro-batches of MICRO_BATCH rows, 4 steps: one epoch."""

from __future__ import annotations

import dpo_common as dpo
import sft_common as sft

ROWS, STEPS, MICROBATCHES, MICRO_BATCH = 32, 4, 2, 4
FIELDS = {**sft.FIELDS, "max_steps": STEPS, "max_length": 48, "beta": 0.1,
          "precompute_ref_log_probs": True}
LORA_TARGETS = "all-linear"
# name -> (layout, LoRA through KTOTrainer's peft_config, KTOConfig fields over FIELDS, policy
# loaded from a saved directory)
RUNS = {
    "kto-dp1tp2pp2": ((1, 2, 2), False, {}, False),
    # KTOConfig's defaults: TRL's reference is a frozen copy loaded from the policy's path
    "kto-defaults-dp1tp2pp2": ((1, 2, 2), False, {"precompute_ref_log_probs": False}, True),
    # LoRA: TRL's reference is the model with its adapters off, run on every batch
    "kto-lora-dp1tp2pp2": ((1, 2, 2), True, {"precompute_ref_log_probs": False}, False),
    # APO-zero, unpaired: no KL term (one model call per batch)
    "kto-apo-dp1tp2pp2": ((1, 2, 2), False, {"loss_type": "apo_zero_unpaired"}, False)}
# evaluate() after training on EVAL_ROWS held-out rows (2 steps of MICRO_BATCH): name -> as RUNS
EVAL_ROWS = 8
EVALUATED = {"kto-eval-dp1tp2pp2": ((1, 2, 2), False, {}, False)}
# an explicit ref_model (dpo_common.save_reference's: the policy's architecture, other weights),
# meta-built: its frozen replica split as the policy's runs the pass before training; with
# sync_ref_model before every step, mixed with the policy after steps 2 and 4 (no evaluation
# set: refused with sync). name -> as RUNS
REFERENCED = {
    "kto-refmodel-dp1tp2pp2": ((1, 2, 2), False, {"precompute_ref_log_probs": False}, False),
    "kto-sync-dp1tp2pp2": ((1, 2, 2), False, {"precompute_ref_log_probs": False,
                                              "sync_ref_model": True, "ref_model_sync_steps": 2,
                                              "ref_model_mixup_alpha": 0.5}, False)}
LOGGED = ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen",
          "logps/rejected", "logits/chosen", "logits/rejected", "rewards/margins", "entropy",
          "num_tokens")


def dataset(first: int = 0, rows: int = ROWS):
    """`rows` unpaired rows from dpo_common's preference rows from `first` on."""
    import datasets

    paired = dpo.dataset(first=first, rows=rows)
    labels = [i % 3 != 0 for i in range(rows)]
    return datasets.Dataset.from_dict({
        "prompt": paired["prompt"],
        "completion": [c if good else r for c, r, good in
                       zip(paired["chosen"], paired["rejected"], labels)],
        "label": labels})


def eval_dataset():
    return dataset(first=ROWS, rows=EVAL_ROWS)


def single_process(lora: bool = False, pretrained: str | None = None, evaluate: bool = False,
                   reference: str | None = None, **fields) -> dict:
    """Plain single-process KTOTrainer (with `lora`, LoRA adapters through its peft_config;
    `fields` over FIELDS; the policy loaded from `pretrained`; the ref_model loaded from
    `reference`): what it logs (with `evaluate`, and what evaluate() returns after training,
    under "eval")."""
    import trl

    trainer = trl.KTOTrainer(
        model=dpo.policy(pretrained), processing_class=sft.tokenizer(),
        ref_model=dpo.policy(reference) if reference else None,
        train_dataset=dataset(), eval_dataset=eval_dataset() if evaluate else None,
        peft_config=sft.peft_config(LORA_TARGETS) if lora else None,
        args=trl.KTOConfig(output_dir="out", per_device_train_batch_size=MICRO_BATCH,
                           per_device_eval_batch_size=MICRO_BATCH, **{**FIELDS, **fields}))
    trainer.train()
    figures = logged(trainer.state.log_history)
    if evaluate:
        figures["eval"] = dpo.evaluated(trainer.evaluate())
    return figures


def logged(log_history: list[dict]) -> dict[str, list[float]]:
    steps = [h for h in log_history if "loss" in h and "train_runtime" not in h]
    return {key: [h.get(key) for h in steps] for key in LOGGED}
