"""The schedule grid: each schedule family (1F1B, interleaved 1F1B, zero-bubble, Merak's shifted
critical path with recomputation; the V schedules ZB-V and DualPipeV, on Llama and on a Mixtral, and
interleaved 1F1B with a number of micro-batches no multiple of pp)
through MerakTrainer at the layouts of this world size
(`trainer_common.MATRIX_LAYOUTS`); each run writes its logged losses, grad norms and learning
rates to ``merak-<scenario>.json`` for test_trainer_matrix to compare with single-process HF
Trainer. Runs on the NCCL-contract backend and on plain gloo (one pooled launch each)."""

from __future__ import annotations

import json
import os

import torch.distributed as dist
from common import out_dir, run_scenarios
from trainer_common import (
    COMMON,
    DP,
    MATRIX_REFERENCES,
    MICRO_BATCH,
    MICROBATCHES,
    build,
    fine_tuning_eval_set,
    fine_tuning_set,
    matrix_runs,
)

import merak


def run(name: str, reference: str, layout: tuple[int, int, int], fields: dict) -> None:
    dp, tp, pp = layout
    merak.init(dp=dp, tp=tp, pp=pp)
    family, hf_fields, _ = MATRIX_REFERENCES[reference]
    with merak.init_empty_weights():
        model = build(family)
    rows = hf_fields.get("per_device_train_batch_size", MICRO_BATCH * DP) * hf_fields.get(
        "gradient_accumulation_steps", MICROBATCHES)  # the reference's global batch
    hf_fields = {k: v for k, v in hf_fields.items() if not k.startswith("per_device")}
    fields = {**COMMON, **hf_fields, **fields}
    # evaluation in HF's batches (MICRO_BATCH * DP rows, over the dp ranks): on padded rows its
    # token-weighted loss depends on them
    args = merak.MerakArguments(output_dir=str(out_dir() / name), save_strategy="no",
                                per_device_train_batch_size=rows // (
                                    dp * fields["gradient_accumulation_steps"]),
                                per_device_eval_batch_size=MICRO_BATCH * DP // dp, **fields)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=fine_tuning_set(),
                                 eval_dataset=fine_tuning_eval_set(padded=True))
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if dist.get_rank() == 0:
        (out_dir() / f"merak-{name}.json").write_text(json.dumps({
            "reference": reference, "loss": [h["loss"] for h in logs],
            "grad_norm": [h["grad_norm"] for h in logs],
            "learning_rate": [h["learning_rate"] for h in logs], "eval_loss": eval_loss}))


def scenarios(world_size: int) -> dict:
    return {name: (lambda name=name, spec=spec: run(name, *spec))
            for name, spec in matrix_runs(world_size).items()}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
