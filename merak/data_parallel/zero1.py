"""ZeRO-1: the optimizer state sharded over the data-parallel group (PyTorch's
`ZeroRedundancyOptimizer`); with expert parallelism the experts' state over the
expert-data-parallel group instead (`ExpertZero1`)."""

from __future__ import annotations

import inspect
from collections import ChainMap
from types import SimpleNamespace

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


def _zero(groups: list[dict], optimizer: torch.optim.Optimizer, group
          ) -> ZeroRedundancyOptimizer:
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                   process_group=group, **defaults)


def zero1(optimizer: torch.optim.Optimizer, ctx) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer with its state sharded over the dp (x cp) group (PyTorch's
    `ZeroRedundancyOptimizer`: each dp rank updates its share of the parameters, then broadcasts
    them; gradients are already averaged over dp). With ep > 1 and expert parameters (marked
    ``expert_parallel``) on the stage, an `ExpertZero1`: the experts' state is sharded over the
    edp group (the replicas holding the same experts), the rest over the dp (x cp) group."""
    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optimizer.param_groups]
    experts = [{**g, "params": [p for p in g["params"] if getattr(p, "expert_parallel", False)]}
               for g in groups]
    if getattr(ctx, "ep", 1) == 1 or not any(g["params"] for g in experts):
        return _zero(groups, optimizer, ctx.replica_group)
    dense = [{**g, "params": [p for p in g["params"]
                              if not getattr(p, "expert_parallel", False)]} for g in groups]
    parts = [_zero([g for g in dense if g["params"]], optimizer, ctx.replica_group)] \
        if any(g["params"] for g in dense) else []
    parts.append(_zero([g for g in experts if g["params"]], optimizer, ctx.edp_group))
    return ExpertZero1(parts)


class ExpertZero1(torch.optim.Optimizer):
    """ZeRO-1 under expert parallelism: one `ZeroRedundancyOptimizer` over the dp (x cp) group
    for the dense parameters and one over the edp group for the experts, stepped together.
    Its ``param_groups`` are theirs (a learning-rate scheduler sets both); ``parts`` are the
    two (the experts' last)."""

    def __init__(self, parts: list[ZeroRedundancyOptimizer]):
        self.parts = parts
        groups = [g for part in parts for g in part.param_groups]
        # Optimizer's own bookkeeping (step hooks; schedulers check the type), then its groups
        # are the parts' own dicts
        super().__init__([p for g in groups for p in g["params"]], dict(parts[0].defaults))
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def local(self) -> SimpleNamespace:
        """What this rank steps: its shards' optimizers' groups and state, as one optimizer's."""
        return SimpleNamespace(
            param_groups=[g for part in self.parts for g in part.optim.param_groups],
            state=ChainMap(*(part.optim.state for part in self.parts)))


def local_optimizer(optimizer: torch.optim.Optimizer):
    """What this rank holds: its ZeRO shard's optimizer (both shards' under expert parallelism:
    their groups and state), or the optimizer itself."""
    if isinstance(optimizer, ExpertZero1):
        return optimizer.local()
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
