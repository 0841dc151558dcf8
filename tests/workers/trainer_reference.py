"""Single-process HF Trainer on the same data and init as trainer_parity (see test_trainer).

    python trainer_reference.py --out DIR     # writes reference-<run>.json
    python trainer_reference.py --out DIR --matrix   # the schedule x layout grid's references
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from trainer_common import (
    COMMON,
    DP,
    MATRIX_REFERENCES,
    MICRO_BATCH,
    RUNS,
    build,
    fine_tuning_eval_set,
    fine_tuning_set,
    flow_summary,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--matrix", action="store_true", help="MATRIX_REFERENCES only")
    options = parser.parse_args()
    out = Path(options.out)
    runs = MATRIX_REFERENCES if options.matrix else RUNS
    torch.set_num_threads(2)
    done: dict[str, str] = {}  # (family, HF fields) -> the run already made with them
    for run, (family, extra, _) in runs.items():
        key = json.dumps([family, extra], sort_keys=True)
        if key in done:  # runs differing only in Merak's fields share one HF reference
            for suffix in (".json", "-logits.npy", "-labels.npy"):
                if (out / f"reference-{done[key]}{suffix}").exists():
                    shutil.copy(out / f"reference-{done[key]}{suffix}",
                                out / f"reference-{run}{suffix}")
            continue
        done[key] = run
        model = build(family)
        args = tf.TrainingArguments(output_dir=str(out / f"reference-{run}"),
                                    **{"per_device_train_batch_size": MICRO_BATCH * DP,
                                       "per_device_eval_batch_size": MICRO_BATCH * DP,
                                       **COMMON, "save_strategy": "no", **extra})
        trainer = tf.Trainer(model=model, args=args, train_dataset=fine_tuning_set(),
                             eval_dataset=fine_tuning_eval_set(padded=options.matrix))
        trainer.train()
        flow = flow_summary(trainer) if run.endswith("hf-flow") else {}
        metrics = trainer.evaluate()
        if not options.matrix:  # (the grid compares losses only)
            predicted = trainer.predict(fine_tuning_eval_set())
            np.save(out / f"reference-{run}-logits.npy", predicted.predictions)
            np.save(out / f"reference-{run}-labels.npy", predicted.label_ids)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        (out / f"reference-{run}.json").write_text(json.dumps({
            "loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "learning_rate": [h["learning_rate"] for h in logs],
            "eval_loss": metrics["eval_loss"],
            **flow}))


if __name__ == "__main__":
    main()
