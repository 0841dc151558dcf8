"""One rank of an elastic MerakTrainer job (launched by tests/test_elastic_resume.py): two
torchrun agents (``--nnodes 1:2``, one rank each, ``--max-restarts 1``) train a 4-layer Llama
data-parallel over the world (dp = world size) on padded rows, saving a checkpoint every step,
for STEPS steps.

As a user's script would: the layout follows the world size the attempt gets, the batch fields
are fixed (micro-batch 2, 2 micro-batches: global batch 8 at dp=2), and the run resumes from the
newest complete checkpoint in its output directory when there is one. In the first attempt the
rank of node 1 (whichever agent the rendezvous made node 1), at the start of step KILL_AFTER + 1
(checkpoint-KILL_AFTER written), writes its pid and its agent's to ``<out>/kill-me`` and waits:
the test kills that agent and then the worker (SIGKILL). The
first agent's worker fails, the agent restarts it alone: world 1, dp=1, and the trainer keeps
the checkpoint's global batch by doubling gradient_accumulation_steps.

Each attempt's rank 0 writes its logged steps to ``<out>/attempt-<n>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import transformers as tf
from trainer_common import COMMON, build, fine_tuning_set

import merak
from merak.checkpoint.io import complete_checkpoints

STEPS, KILL_AFTER, MICRO_BATCH = 8, 4, 2
TIMEOUT_S = 30  # the job's: the survivors of the kill fail well inside the test's bound


class KillPoint(tf.TrainerCallback):
    """In the first attempt, on node 1: ask the test to kill this node."""

    def __init__(self, out: Path):
        self.out = out

    def on_step_begin(self, args, state, control, **kwargs):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        victim = os.environ.get("GROUP_RANK") == "1" and os.environ.get("LOCAL_RANK") == "0"
        if first_attempt and victim and state.global_step == KILL_AFTER:
            (self.out / "kill-me").write_text(f"{os.getpid()} {os.getppid()}")  # and its agent
            time.sleep(600)  # killed here


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = int(os.environ["WORLD_SIZE"])
    ctx = merak.init(dp=world, backend="gloo", timeout=TIMEOUT_S)
    with merak.init_empty_weights():
        model = build("llama-deep")
    args = merak.MerakArguments(
        output_dir=str(out / "run"), **{**COMMON, "max_steps": STEPS},
        per_device_train_batch_size=MICRO_BATCH, save_strategy="steps", save_steps=1,
        save_total_limit=2, ddp_timeout=TIMEOUT_S)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=fine_tuning_set(),
                                 callbacks=[KillPoint(out)])
    resume = bool(complete_checkpoints(args.output_dir))
    trainer.train(resume_from_checkpoint=resume or None)
    if ctx.rank == 0:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        (out / f"attempt-{attempt}.json").write_text(json.dumps({
            "world": world, "resumed": resume,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "steps": {h["step"]: [h["loss"], h["grad_norm"], h["learning_rate"]]
                      for h in logs}}))


if __name__ == "__main__":
    main()
