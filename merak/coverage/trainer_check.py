"""`merak coverage --trainer`: families trained through MerakTrainer at dp=2 x tp=2 x pp=2
against single-process HF Trainer on the same initialization and data, 5 steps.

The reference runs in this process; the 8 ranks run `python -m merak.coverage.trainer_check
--worker` under torch.distributed.run and rank 0 writes each family's logged losses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

STEPS, MICRO_BATCH, MICROBATCHES, DP, SEQ, SEED = 5, 2, 2, 2, 16, 1234
COMMON = {"max_steps": STEPS, "learning_rate": 1e-3, "logging_steps": 1, "seed": SEED,
          "train_sampling_strategy": "sequential", "gradient_accumulation_steps": MICROBATCHES,
          "report_to": "none", "disable_tqdm": True, "use_cpu": True, "save_strategy": "no"}
LOSS_ATOL = 2e-4  # both trainers log losses rounded to 4 digits


def train_set() -> list[dict[str, torch.Tensor]]:
    from merak.coverage.shrink import VOCAB

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB - 1, (STEPS * MICRO_BATCH * MICROBATCHES * DP, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _small_model(family: str, checkpoint: str | None = None):
    """The family's shrunken model, seeded; or, with `checkpoint` (a directory `save_small`
    wrote), loaded from it as a user's model is (`from_pretrained`)."""
    if checkpoint is not None:
        import transformers as tf

        return tf.AutoModelForCausalLM.from_pretrained(checkpoint)
    from merak.coverage.shrink import build_small

    return build_small(family, seed=SEED).build()


def save_small(family: str, directory: str) -> str:
    """The family's shrunken seeded model written by `save_pretrained` into `directory`."""
    _small_model(family).save_pretrained(directory)
    return directory


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def merak_losses(family: str, checkpoint: str | None = None) -> list[float]:
    """The losses MerakTrainer logs on the layout of `merak.init`'s context (call on every
    rank), the model built under `merak.init_empty_weights` (from `checkpoint` when given)."""
    import merak

    with merak.init_empty_weights():
        model = _small_model(family, checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        args = merak.MerakArguments(output_dir=tmp, per_device_train_batch_size=MICRO_BATCH,
                                    **COMMON)
        trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set())
        trainer.train()
    return losses(trainer)


def reference(family: str, out_dir: str, dp: int = DP, checkpoint: str | None = None
              ) -> list[float]:
    """HF Trainer on one process, stepping on the same global batch in the same micro-batches
    (one per Merak micro-batch: dp x gradient accumulation of them); the model seeded, or
    loaded from `checkpoint`.

    A mixture-of-experts loss is not linear in the batch (its auxiliary load-balancing term is
    computed per forward), so the micro-batches must be the same ones: HF Trainer, for a model
    that takes ``num_items_in_batch``, sums the micro-batch losses (token losses over the
    step's count, plus each micro-batch's auxiliary term), and so does MerakTrainer."""
    import transformers as tf

    options = {**COMMON, "gradient_accumulation_steps": MICROBATCHES * dp}
    args = tf.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=MICRO_BATCH,
                                **options)
    trainer = tf.Trainer(model=_small_model(family, checkpoint), args=args,
                         train_dataset=train_set())
    trainer.train()
    return losses(trainer)


def worker(families: list[str], out: Path) -> None:
    import merak
    from merak.distributed.host_objects import all_gather_objects

    for family in families:
        result: dict = {"family": family}
        try:
            ctx = merak.init(dp=2, tp=2, pp=2)
            result["loss"] = merak_losses(family)
        except Exception as error:  # a family's failure is its result
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        gathered = all_gather_objects(result)
        if ctx.rank == 0:
            failed = next((r for r in gathered if "error" in r), None)
            with open(out, "a") as f:
                f.write(json.dumps(failed or result) + "\n")


def check_trainer(families: list[str]) -> list[dict]:
    """Per family: {'family', 'result' (a sentence), 'merak', 'hf'}."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trainer.jsonl"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "8",
                   "--master_port", str(29500 + os.getpid() % 1000), "-m",
                   "merak.coverage.trainer_check", "--worker", "--families", ",".join(families),
                   "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        code = subprocess.run(command, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, check=False).returncode
        merak_rows = {r["family"]: r for r in (json.loads(x) for x in out.read_text().splitlines())
                      } if out.exists() else {}
        for family in families:
            ours = merak_rows.get(family, {"error": f"the 8-rank run exited with {code}"})
            row = {"family": family, "merak": ours.get("loss")}
            if "error" in ours:
                row["result"] = f"FAIL {ours['error']}"
            else:
                theirs = reference(family, str(Path(tmp) / family))
                row["hf"] = theirs
                diff = max(abs(a - b) for a, b in zip(ours["loss"], theirs))
                same = len(ours["loss"]) == len(theirs) == STEPS and diff <= LOSS_ATOL
                row["result"] = (f"{'ok' if same else 'FAIL'}: losses {ours['loss']} vs "
                                 f"{theirs} (max difference {diff:.1e})")
            rows.append(row)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--families", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    worker(cli.families.split(","), Path(cli.out))
