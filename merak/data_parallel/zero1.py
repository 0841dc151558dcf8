"""ZeRO-1: the optimizer state sharded over the data-parallel group (PyTorch's
`ZeroRedundancyOptimizer`)."""

from __future__ import annotations

import inspect

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


def zero1(optimizer: torch.optim.Optimizer, ctx) -> ZeroRedundancyOptimizer:
    """ZeRO-1: the same optimizer with its state sharded over the dp (x cp) group (PyTorch's
    `ZeroRedundancyOptimizer`: each dp rank updates its share of the parameters, then broadcasts
    them; gradients are already averaged over dp)."""
    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                   process_group=ctx.replica_group, **defaults)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """What this rank holds: its ZeRO shard's optimizer, or the optimizer itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
