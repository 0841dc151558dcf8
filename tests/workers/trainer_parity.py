"""MerakTrainer on dp=2 x tp=2 x pp=2 (8 ranks): writes its logged losses, grad norms,
learning rates and eval loss for test_trainer to compare with the HF Trainer reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from common import run_scenarios
from trainer_common import COMMON, FAMILIES, MICRO_BATCH, build, eval_set, train_set

import merak

OUT = Path(os.environ.get("MERAK_TRAINER_OUT", "."))


def run(family: str) -> None:
    ctx = merak.init(dp=2, tp=2, pp=2)
    with merak.init_empty_weights():
        model = build(family)
    args = merak.MerakArguments(output_dir=str(OUT / family),
                                per_device_train_batch_size=MICRO_BATCH,
                                per_device_eval_batch_size=MICRO_BATCH, parallel_vocab=True,
                                wall_clock_breakdown=True, **COMMON)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 eval_dataset=eval_set())
    trainer.train()
    metrics = trainer.evaluate()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == COMMON["max_steps"], f"{len(logs)} training logs"
    assert all(h["tokens_per_second"] > 0 and h["time_forward_ms"] > 0 for h in logs)
    trainer.args.eval_iters = 1
    assert trainer.evaluate()["eval_steps"] == 1 and metrics["eval_steps"] == 3
    if ctx.rank == 0:
        (OUT / f"merak-{family}.json").write_text(json.dumps({
            "loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "learning_rate": [h["learning_rate"] for h in logs],
            "eval_loss": metrics["eval_loss"]}))
    dist.barrier()


if __name__ == "__main__":
    run_scenarios({f"trainer-{f}": (lambda f=f: run(f)) for f in FAMILIES})
