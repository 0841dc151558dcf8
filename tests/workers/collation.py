"""Collation per micro-batch through MerakTrainer at (dp, tp, pp) = (1,2,2)
and (2,1,2): HF Trainer with `DataCollatorWithFlattening`, and TRL's SFTTrainer with packing,
padding-free batches and prompt-completion rows (the runs of `collation_common`). Each run writes
its logged losses, grad norms (and TRL's metrics) to ``merak-<scenario>.json`` for
test_collation to compare with the single-process trainer."""

from __future__ import annotations

import json
import os

import collation_common as cc
import sft_common as sft
import torch.distributed as dist
from common import out_dir, run_scenarios

import merak


def run(name: str, kind: str, layout: tuple[int, int, int]) -> None:
    dp, tp, pp = layout
    if cc.KINDS[kind][0] == "hf":
        config, trainer_cls = merak.MerakArguments, merak.MerakTrainer
    else:
        import trl

        config, trainer_cls = sft.merak_classes(trl.SFTConfig, trl.SFTTrainer)

    merak.init(dp=dp, tp=tp, pp=pp)
    with merak.init_empty_weights():
        model = sft.model()
    args = config(output_dir=str(out_dir() / name),
                  per_device_train_batch_size=cc.GLOBAL_MICRO_BATCH // dp, **cc.fields(kind))
    trainer = trainer_cls(model=model, args=args, **cc.trainer_inputs(kind))
    trainer.train()
    if dist.get_rank() == 0:
        (out_dir() / f"merak-{name}.json").write_text(json.dumps(
            cc.logged(kind, trainer.state.log_history)))


def scenarios(world_size: int) -> dict:
    if world_size != 4:
        return {}
    return {name: (lambda name=name, kind=kind, layout=layout: run(name, kind, layout))
            for name, (kind, layout) in cc.SCENARIOS.items()}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
