"""The optimizer's state in a checkpoint, on torch.distributed.checkpoint (DCP), resharded on load
into any layout. Every per-parameter state (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's
momentum, any optimizer whose state is per parameter) is stored under its parameter's name (the
stage's ``named_parameters()``: the user's model's names, as the weight files hold them), as the
whole logical tensor: each rank describes the boxes of it it holds (`merak.checkpoint.sharded`:
tensor-parallel parts, ZeRO-2/3 rows, expert-parallel experts), ZeRO-1 ranks only the parameters
whose state they own. DCP writes each box once (replicas of dp, cp and pp-tied copies are
deduplicated) with its offsets, and a load, in whatever (dp, tp, pp, cp, ep) layout, schedule or
ZeRO stage, reads for each rank just the slices of the state its own parameters need. Scalars
(Adam's ``step``) are the same on every rank and stored once.

The optimizer is given its state before loading (a step with zero gradients at learning rate
0, as torch's own state-dict helpers do: the parameters do not change), then DCP fills it in
place. The learning rates are the scheduler's (restored with it); the other hyperparameters are
those the optimizer was built with.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from merak.checkpoint import sharded
from merak.checkpoint.files import CheckpointError, IncompleteCheckpointError, listed
from merak.checkpoint.sharded import Pieces, pieces_of, shard_spec
from merak.data_parallel.zero1 import local_optimizer

OPTIMIZER_DIR = "optimizer"  # inside a checkpoint directory


def _entries(optimizer: torch.optim.Optimizer, stage: nn.Module, for_load: bool,
             copy: bool = False) -> dict:
    """``{"state": {parameter name: {state key: value}}}`` of this rank's optimizer, every
    tensor as DCP should see it (see the module doc); with `copy` (a save in the background)
    every tensor is a host copy no later step changes."""
    def saved(value: torch.Tensor) -> torch.Tensor:
        return value if for_load else value.detach().to("cpu", copy=copy)

    local = local_optimizer(optimizer)
    names = {id(p): n for n, p in stage.named_parameters()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = {}
    for group in local.param_groups:
        for param in group["params"]:
            values = local.state.get(param)
            if not values:
                continue
            name = names.get(id(param))
            if name is None:
                raise CheckpointError("the optimizer steps a parameter the stage does not hold "
                                      "by name; Merak checkpoints only the stage's parameters")
            spec = shard_spec(param)
            entry = {}
            for key, value in values.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
                    entry[key] = pieces_of(value, spec, for_load, copy)
                elif torch.is_tensor(value) and value.dim() > 0:
                    # shaped otherwise (Adafactor's factored moments, quantized blocks): not a
                    # part of a whole tensor Merak can place; this rank's own, for a resume in
                    # the same layout (another layout names it missing)
                    entry[f"{key}@rank{rank}"] = saved(value)
                elif torch.is_tensor(value):  # per-parameter scalars: the same on every rank
                    entry[key] = saved(value)
                else:
                    entry[key] = value
            state[name] = entry
    return {"state": state}


def optimizer_entries(optimizer: torch.optim.Optimizer, stage: nn.Module,
                      copy: bool = False) -> dict:
    """This rank's part of the optimizer's state as `write_optimizer_state` takes it; with
    `copy`, staged: host copies no later step changes (a save in the background)."""
    return _entries(optimizer, stage, for_load=False, copy=copy)


def write_optimizer_state(path: Path, entries: dict, group=None) -> None:
    """Write `optimizer_entries` to `path` (a collective of every rank of `group`, default the
    job's)."""
    sharded.save(path, entries, group, kind="optimizer")


def save_optimizer_state(path: Path, optimizer: torch.optim.Optimizer, stage: nn.Module) -> None:
    """Write this rank's part of the optimizer's state to `path` (a collective of every rank)."""
    write_optimizer_state(path, optimizer_entries(optimizer, stage))


def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter its optimizer state without changing it: one step with
    zero gradients at learning rate 0 (a collective under ZeRO: every rank calls it)."""
    local = local_optimizer(optimizer)
    params = [p for g in local.param_groups for p in g["params"] if p.requires_grad]
    if all(local.state.get(p) for p in params):
        return
    every = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    rates = [g["lr"] for g in optimizer.param_groups]
    for param in every:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 0.0 if not torch.is_tensor(group["lr"]) else group["lr"] * 0
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        optimizer.zero_grad(set_to_none=True)


def _flat_items(entries: dict, prefix: str = ""):
    """(DCP's flattened key, value) of a nested state dict: keys joined by dots."""
    for key, value in entries.items():
        if isinstance(value, dict):
            yield from _flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def load_optimizer_state(path: Path, optimizer: torch.optim.Optimizer, stage: nn.Module) -> None:
    """Fill this rank's optimizer from the state at `path`, saved in any layout (a collective).

    Raises:
        IncompleteCheckpointError: `path` is not there, or lacks the state of parameters this
            rank steps (their names).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise IncompleteCheckpointError(f"{path.parent} holds no optimizer state ({path.name}/ "
                                        f"is missing or incomplete: saved with no_save_optim or "
                                        f"save_only_model?); resume with no_load_optim=True")
    initialize_state(optimizer)
    entries = _entries(optimizer, stage, for_load=True)
    flat = dict(_flat_items(entries))
    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    missing = [k for k in flat if k not in saved]
    if missing:
        raise IncompleteCheckpointError(
            f"{path} lacks the optimizer state this rank needs: "
            f"{listed([k.removeprefix('state.') for k in missing], 6)}; was it "
            f"saved from another model, or with other parameters trainable?")
    sharded.load(path, flat)
    local = local_optimizer(optimizer)
    names = dict(stage.named_parameters())
    for name, values in entries["state"].items():  # values DCP replaced rather than filled
        state = local.state[names[name]]
        for key, value in values.items():
            if not torch.is_tensor(value) and not isinstance(value, Pieces):
                state[key] = flat[f"state.{name}.{key}"]
            elif "@rank" in key:  # filled in place; under the optimizer's own key
                state[key.split("@rank")[0]] = value
