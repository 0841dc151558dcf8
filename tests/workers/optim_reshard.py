"""A checkpoint resumed in another layout keeps its optimizer state (see test_checkpoint_reshard):
a 4-layer Llama trained by MerakTrainer (AdamW, HF Trainer's global batch of 8 padded rows of
varying length) at (dp, tp, pp) = (1, 2, 2) for 6 steps saves its step-3 checkpoint (in the
background, `save_async`); each other scenario resumes that checkpoint in another layout,
schedule or ZeRO stage and trains steps 4-6 (the same layout's resume is test_trainer's).
Every run writes its logged losses, grad norms and learning rates to ``merak-<scenario>.json``;
the test compares steps 4-6 with the uninterrupted run, and that run with single-process HF
Trainer."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import transformers as tf
from common import out_dir, run_scenarios
from trainer_common import COMMON, DP, MICRO_BATCH, MICROBATCHES, build, fine_tuning_set

import merak

STEPS, SAVED = 6, 3
SOURCE = "optim-dp1tp2pp2"
# an MoE family loaded from its saved (Hub-layout) checkpoint on the meta device: a Mixtral
# trained at (1, 2, 2) (experts cut over tp), resumed at (1, 1, 4) (the experts whole again, on
# other stages). Its router's load-balancing loss is computed per micro-batch, so a resume keeps
# the micro-batch size (a layout with another dp and the same global batch has another one).
MOE_SOURCE, MOE_RESUME = "optim-moe-dp1tp2pp2", "optim-moe-resume-dp1tp1pp4"
# scenario -> ((dp, tp, pp), more MerakArguments fields)
RESUMES = {
    "optim-resume-dp1tp1pp4": ((1, 1, 4), {}),
    # the source job's batch fields as they are: the trainer brings gradient_accumulation_steps
    # from 2 down to 1 to keep the checkpoint's global batch of 8 rows at dp=2
    "optim-resume-dp2tp2pp1-zero3": ((2, 2, 1), {"zero_stage": 3,
                                                 "per_device_train_batch_size": 4}),
    "optim-resume-dp4tp1pp1-zero1": ((4, 1, 1), {"zero_stage": 1}),
    "optim-resume-dp2tp1pp2-interleaved": ((2, 1, 2), {"train_schedule": "interleaved_1f1b",
                                                        "num_model_chunks": 2}),
}


def fields() -> dict:
    """HF Trainer's fields (both trainers)."""
    return {**COMMON, "max_steps": STEPS}


def _moe_checkpoint() -> Path:
    """The small Mixtral saved with save_pretrained (rank 0, once)."""
    path = out_dir() / "mixtral-hub"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        build("mixtral-deep").save_pretrained(path)
    dist.barrier()
    return path


def run(name: str, layout: tuple[int, int, int], extra: dict, resume: str | None = None,
        moe: bool = False) -> None:
    dp, tp, pp = layout
    merak.init(dp=dp, tp=tp, pp=pp)
    hub = _moe_checkpoint() if moe else None
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_pretrained(hub) if moe else build("llama-deep")
    rows = MICRO_BATCH * DP * MICROBATCHES  # the reference's global batch
    args = merak.MerakArguments(output_dir=str(out_dir() / name), **{
        "per_device_train_batch_size": rows // (dp * MICROBATCHES), "save_strategy": "no",
        **fields(), **extra})
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=fine_tuning_set())
    trainer.train(resume_from_checkpoint=resume)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp
    assert global_batch == rows, (name, global_batch, rows)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if dist.get_rank() == 0:
        (out_dir() / f"merak-{name}.json").write_text(json.dumps({
            "step": [h["step"] for h in logs], "loss": [h["loss"] for h in logs],
            "grad_norm": [h["grad_norm"] for h in logs],
            "learning_rate": [h["learning_rate"] for h in logs]}))


def scenarios(world_size: int) -> dict:
    assert world_size == 4, world_size
    # saved in the background: step 4 runs (changing weights and moments in place) while
    # checkpoint-3 is written, which the resumes read
    found = {SOURCE: lambda: run(SOURCE, (1, 2, 2), {"save_strategy": "steps",
                                                     "save_steps": SAVED, "save_async": True})}
    for name, (layout, extra) in RESUMES.items():
        found[name] = lambda name=name, layout=layout, extra=extra: run(
            name, layout, extra, resume=str(out_dir() / SOURCE / f"checkpoint-{SAVED}"))
    found[MOE_SOURCE] = lambda: run(MOE_SOURCE, (1, 2, 2), {
        "save_strategy": "steps", "save_steps": SAVED}, moe=True)
    found[MOE_RESUME] = lambda: run(MOE_RESUME, (1, 1, 4), {}, moe=True, resume=str(
        out_dir() / MOE_SOURCE / f"checkpoint-{SAVED}"))
    return found


if __name__ == "__main__":
    import os

    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
