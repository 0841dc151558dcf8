"""Context parallelism through MerakTrainer (see test_context_parallel_trainer): a 4-layer Llama
(8 heads, 4 key/value heads; 2 key/value heads in the kv-repeated run) on full rows of 12 tokens
at (dp, tp, pp, cp) = (1,1,2,2), (1,2,1,2) and (2,1,1,2) on 4 ranks ((2,1,2,2) and (1,4,1,2) on 8
with MERAK_TEST_MATRIX=full), 5 steps of HF Trainer's global batch, then evaluate(); each run
writes its logged losses, grad norms, learning rates and eval loss to ``merak-<scenario>.json``
for the test to compare with single-process HF Trainer."""

from __future__ import annotations

import json
import os

import torch.distributed as dist
from common import out_dir, run_scenarios
from trainer_common import (
    COMMON,
    DP,
    MICRO_BATCH,
    MICROBATCHES,
    build,
    eval_set,
    train_set,
)

import merak

STEPS = 5
SAVED = 3  # the step cp-dp1tp1pp2cp2-ring saves
# scenario -> (the run whose checkpoint it resumes, its own layout, cp_mode, more fields): the
# same layout, and cp=1 at dp=2 (weights and optimizer state resharded), continue the curve
RESUMES = {4: {"cp-resume-same-layout": ("cp-dp1tp1pp2cp2-ring", (1, 1, 2, 2), "ring", {}),
               "cp-resume-dp2tp1pp2cp1": ("cp-dp1tp1pp2cp2-ring", (2, 1, 2, 1), "ring", {})}}
# scenario -> ((dp, tp, pp, cp), cp_mode, more MerakArguments fields)
CP_RUNS = {
    # (saves its step-3 checkpoint: the weight files of a cp=1 job, cp recorded)
    4: {"cp-dp1tp1pp2cp2-ring": ((1, 1, 2, 2), "ring", {"save_strategy": "steps",
                                                      "save_steps": SAVED}),
        # 2 key/value heads over tp=2 leave each TP rank 1, which cp=2 does not divide: Ulysses
        # repeats each twice (the query heads keep their key heads)
        "cp-dp1tp2pp1cp2-ulysses-kv-repeated": ((1, 2, 1, 2), "ulysses", {}),
        "cp-dp1tp2pp1cp2-ring-sp": ((1, 2, 1, 2), "ring", {"sequence_parallel": True}),
        # the split backward of zero-bubble schedules; model chunks of interleaved 1F1B
        "cp-dp1tp1pp2cp2-ulysses-zero-bubble": ((1, 1, 2, 2), "ulysses",
                                                {"train_schedule": "zero_bubble"}),
        "cp-dp1tp1pp2cp2-ring-interleaved": ((1, 1, 2, 2), "ring", {
            "train_schedule": "interleaved_1f1b", "num_model_chunks": 2}),
        # every block rerun inside the backward (the ring's collectives with it)
        "cp-dp1tp1pp2cp2-ring-recompute-in-backward": ((1, 1, 2, 2), "ring", {
            "activation_checkpointing": True, "recompute_in_backward": True}),
        # gradients reduced over dp x cp (each dp rank's cp pair holds half a row's tokens):
        # Ulysses with the stage's recomputation action rerunning the blocks (their all-to-alls
        # with them), and ring with ZeRO-2 sharding the gradients over dp
        "cp-dp2tp1pp1cp2-ulysses-recompute": ((2, 1, 1, 2), "ulysses",
                                              {"activation_checkpointing": True}),
        "cp-dp2tp1pp1cp2-ring-zero2": ((2, 1, 1, 2), "ring", {"zero_stage": 2})},
}
if os.environ.get("MERAK_TEST_MATRIX") == "full":  # the same with pp2, and tp4 (8 ranks)
    CP_RUNS[8] = {
        "cp-dp2tp1pp2cp2-ulysses-recompute": ((2, 1, 2, 2), "ulysses",
                                              {"activation_checkpointing": True}),
        "cp-dp2tp1pp2cp2-ring-zero2": ((2, 1, 2, 2), "ring", {"zero_stage": 2}),
        # 4 key/value heads over tp=4: one per TP rank, repeated for cp=2
        "cp-dp1tp4pp1cp2-ulysses-kv-repeated": ((1, 4, 1, 2), "ulysses", {})}
# the model of each scenario that is not llama-deep's: one key/value head per TP rank at tp=2
FAMILIES = {"cp-dp1tp2pp1cp2-ulysses-kv-repeated": "llama-deep-kv2"}


def family(scenario: str) -> str:
    return FAMILIES.get(scenario, "llama-deep")


def reference_fields() -> dict:
    """HF Trainer's fields (both trainers): COMMON for 5 steps."""
    return {**COMMON, "max_steps": STEPS}


def run(name: str, layout: tuple[int, int, int, int], mode: str, extra: dict,
        resume: str | None = None) -> None:
    dp, tp, pp, cp = layout
    merak.init(dp=dp, tp=tp, pp=pp, cp=cp)
    with merak.init_empty_weights():
        model = build(family(name))
    fields = reference_fields()
    rows = MICRO_BATCH * DP * MICROBATCHES  # the reference's global batch
    args = merak.MerakArguments(
        output_dir=str(out_dir() / name), cp_mode=mode,
        per_device_train_batch_size=rows // (dp * fields["gradient_accumulation_steps"]),
        per_device_eval_batch_size=MICRO_BATCH * DP // dp,
        **{"save_strategy": "no", **fields, **extra})
    eval_rows = [{**row, "attention_mask": row["input_ids"].new_ones(row["input_ids"].shape)}
                 for row in eval_set()]
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 eval_dataset=eval_rows)
    trainer.train(resume_from_checkpoint=resume)
    eval_loss = trainer.evaluate()["eval_loss"]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if dist.get_rank() == 0:
        (out_dir() / f"merak-{name}.json").write_text(json.dumps({
            "loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "learning_rate": [h["learning_rate"] for h in logs], "eval_loss": eval_loss}))


def resume(name: str, saved_by: str, layout: tuple[int, int, int, int], mode: str,
           extra: dict) -> None:
    """`layout` resumes the step-3 checkpoint of `saved_by`."""
    checkpoint = out_dir() / saved_by / f"checkpoint-{SAVED}"
    run(name, layout, mode, extra, resume=str(checkpoint))


def scenarios(world_size: int) -> dict:
    found = {name: (lambda name=name, spec=spec: run(name, *spec))
             for name, spec in CP_RUNS.get(world_size, {}).items()}
    return found | {name: (lambda name=name, spec=spec: resume(name, *spec))
                    for name, spec in RESUMES.get(world_size, {}).items()}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
