"""MerakTrainer on the families sharded by the plan inferred from their blocks,
loaded as a new user's model is (written by save_pretrained, read by from_pretrained under
merak.init_empty_weights), at dp1 x tp2 x pp1 (the 2-rank launch) and dp2 x tp2 x pp2 (the
8-rank one; see FAMILIES), 5 steps; rank 0 writes each run's logged losses, which
test_tp_infer compares with single-process HF Trainer's on the same checkpoint and batches."""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist
from common import out_dir, run_scenarios
from tp_models import INFERRED

import merak
from merak.coverage.trainer_check import merak_losses, save_small

LAYOUTS = {2: (1, 2, 1), 8: (2, 2, 2)}
# the suite trains every family at dp1 x tp2 x pp1 and three at dp2 x tp2 x pp2 (BLOOM's ALiBi
# sliced on every pipeline stage, MPT's fused q/k/v, OpenAI-GPT's Conv1D split; 8 ranks on 2
# cores cost ~30 s a family); MERAK_TEST_MATRIX=full trains all eight there too
FAMILIES = {2: INFERRED, 8: INFERRED if os.environ.get("MERAK_TEST_MATRIX") == "full"
            else ("bloom", "mpt", "openai-gpt")}


def run_name(family: str, layout: tuple[int, int, int]) -> str:
    return f"trainer-inferred-{family}-dp{layout[0]}tp{layout[1]}pp{layout[2]}"


def trainer_run(family: str, layout: tuple[int, int, int]):
    def scenario() -> None:
        merak.init(dp=layout[0], tp=layout[1], pp=layout[2])
        hub = out_dir() / f"hub-{run_name(family, layout)}"
        if dist.get_rank() == 0:  # save_pretrained writes on rank 0 only
            save_small(family, str(hub))
        dist.barrier()
        found = merak_losses(family, str(hub))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(hub, ignore_errors=True)
            (out_dir() / f"{run_name(family, layout)}.json").write_text(json.dumps(found))
    return scenario


def scenarios(world_size: int) -> dict:
    layout = LAYOUTS.get(world_size)
    return {run_name(f, layout): trainer_run(f, layout) for f in FAMILIES.get(world_size, ())}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
