"""auto_split stages, built on the meta device, trained with the 1f1b interpreter against the
eager single-process model (see test_auto_split)."""

from __future__ import annotations

import os

import torch
from common import Compared, GradSnapshot, run_scenarios
from hf_models import FAMILIES, batch

import merak
from merak.materialize.meta import materialize_
from merak.partition.auto import auto_split

STEPS, MICROBATCHES, ROWS, LR, SEED = 3, 2, 2, 0.05, 4321

# family -> {pp: auto_split options}; every trace_method, split_method and partition_method
# appears
OPTIONS = {
    "llama": {2: {}, 4: {"split_method": "nearest_min_deps", "partition_method": "parameters"}},
    "qwen2": {2: {"split_method": "layer_split", "custom_split_points": ["model.layers.1"]},
              4: {"partition_method": "uniform_floor"}},
    "mistral": {2: {"partition_method": "custom", "custom_partition": [0, 3, 4]}, 4: {}},
    "gpt2": {2: {"partition_method": "parameters"}, 4: {}},
    "opt": {2: {"split_method": "nearest_min_deps"}, 4: {}},
    "bert": {2: {"trace_method": "dynamo"}, 4: {"split_method": "nearest_min_deps"}},
    "t5": {2: {}, 4: {}},
    "mlp": {2: {"partition_method": "profile", "trace_method": "fx", "leaf_modules": ["head"]},
            4: {"partition_method": "parameters", "trace_method": "dynamo"}},
}
EAGER_BUILD = {"mlp"}  # profile times real blocks, so this one is built eagerly


def families(world_size: int) -> list[str]:
    """Every family at pp=2; at pp=4 those whose options differ from the defaults or whose
    structure does (the encoder-decoder), within the suite's time budget."""
    return [f for f in OPTIONS if world_size == 2 or OPTIONS[f][4] or f == "t5"]


def scenario_names(world_size: int) -> list[str]:
    return [f"auto-{family}-pp{world_size}" for family in families(world_size)]


def parity(family: str, pp: int) -> dict:
    ctx = merak.init(dp=1, tp=1, pp=pp)
    torch.manual_seed(SEED)
    if family in EAGER_BUILD:
        model = FAMILIES[family]()
    else:
        with merak.init_empty_weights():
            model = FAMILIES[family]()
    split = auto_split(model, batch(family, 0, ROWS), pp, **OPTIONS[family][pp])
    stage = merak.PipelineStage(split.container, split, ctx.pp_rank)
    materialize_(stage)
    snapshot = GradSnapshot(stage)
    grads = snapshot.grads
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=LR),
                                       num_microbatches=MICROBATCHES, schedule="1f1b",
                                       hooks=[snapshot])
    losses = [engine.train_step(batch(family, step, ROWS * MICROBATCHES))
              for step in range(STEPS)]

    torch.manual_seed(SEED)
    reference = FAMILIES[family]()
    params = dict(reference.named_parameters())
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    compared, ref_losses = Compared(), []
    for step in range(STEPS):
        out = reference(**batch(family, step, ROWS * MICROBATCHES))
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        ref_losses.append(loss.item())
        for name, grad in grads[step].items():
            compared.value(f"step {step} grad of {name}", grad, params[name].grad)
        optimizer.step()
        optimizer.zero_grad()
    compared.value("losses", losses, ref_losses)
    own = dict(stage.named_parameters())
    for name, param in own.items():
        compared.value(f"{name} after {STEPS} steps", param, params[name].detach())
    if ctx.rank == 0:
        print(f"{family} pp={pp} {OPTIONS[family][pp]}\n{split.describe()}", flush=True)
    return compared.figures(params=len(own), params_without_grad=sorted(set(own) - set(grads[0])))


def scenarios(world_size: int) -> dict:
    return {f"auto-{f}-pp{world_size}": (lambda f=f: parity(f, world_size))
            for f in families(world_size)}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
