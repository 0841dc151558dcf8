"""Tensors that ZeRO-2/3 (FSDP2) shards over the dp ranks are DTensors; these read them the
same way as the plain tensors of every other layout."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def is_sharded(tensor: torch.Tensor | None) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (the tensor itself otherwise); shares its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor; for a sharded one a collective over the dp group (every dp rank
    calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def this_ranks_part(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the whole tensor `value`, cut as `like` (a parameter or optimizer
    state tensor) is sharded; `value` itself for an unsharded `like`. Every dp rank holds the
    whole `value`, so nothing is communicated."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements,
                             src_data_rank=None).to_local()


def optimizer_state_to_local(state: dict) -> dict:
    """An optimizer's `state_dict()` with every sharded tensor replaced by this rank's part
    (what a rank's checkpoint file holds: plain tensors, loadable with ``weights_only``)."""
    return {**state, "state": {index: {k: local(v) if torch.is_tensor(v) else v
                                       for k, v in per_param.items()}
                               for index, per_param in state["state"].items()}}


def optimizer_state_from_local(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """The inverse of `optimizer_state_to_local` for `optimizer`: each saved part of a sharded
    parameter's state becomes a DTensor sharded as the parameter is."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for index, per_param in state["state"].items():
        param = params[int(index)]
        if isinstance(param, DTensor):
            part = param.to_local().shape
            per_param = {k: DTensor.from_local(v.to(param.device), param.device_mesh,
                                               param.placements, run_check=False,
                                               shape=param.shape, stride=param.stride())
                         if torch.is_tensor(v) and v.shape == part and v.dim() > 0 else v
                         for k, v in per_param.items()}
        out[index] = per_param
    return {**state, "state": out}
