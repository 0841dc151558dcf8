"""ZeRO-1: the optimizer state sharded over the data-parallel group (PyTorch's
`ZeroRedundancyOptimizer`); with expert parallelism the experts' state over the
expert-data-parallel group instead (`ExpertZero1`)."""

from __future__ import annotations

import inspect
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
    parts, owners = [], []  # owners[k][j]: the group of `groups` part k's group j comes from
    for split, group in ((dense, ctx.replica_group), (experts, ctx.edp_group)):
        kept = [i for i, g in enumerate(split) if g["params"]]
        if kept:
            parts.append(_zero([split[i] for i in kept], optimizer, group))
            owners.append(kept)
    return ExpertZero1(groups, parts, owners)


class ExpertZero1(torch.optim.Optimizer):
    """ZeRO-1 under expert parallelism: one `ZeroRedundancyOptimizer` over the dp (x cp) group
    for the dense parameters and one over the edp group for the experts, stepped together
    (``parts``, the experts' last). Its ``param_groups`` are the optimizer's own (the same
    number, so a learning-rate scheduler's state fits any layout); each step first copies their
    hyperparameters (the scheduler's learning rate) into the parts' groups made from them."""

    def __init__(self, groups: list[dict], parts: list[ZeroRedundancyOptimizer],
                 owners: list[list[int]]):
        self.parts, self.owners = parts, owners
        # Optimizer's own bookkeeping (step hooks; schedulers check the type); no state
        super().__init__(groups, dict(parts[0].defaults))

    @torch.no_grad()
    def step(self, closure=None):
        for part, owner in zip(self.parts, self.owners):
            for group, i in zip(part.param_groups, owner):
                group.update({k: v for k, v in self.param_groups[i].items() if k != "params"})
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def local(self) -> SimpleNamespace:
        """What this rank steps: its shards' optimizers' groups and state, as one optimizer's."""
        # a plain dict of the parts' own per-parameter dicts (a ChainMap would look a parameter
        # up in the first part's defaultdict first, which makes it an empty state there)
        return SimpleNamespace(
            param_groups=[g for part in self.parts for g in part.optim.param_groups],
            state={p: s for part in self.parts for p, s in part.optim.state.items()})


def local_optimizer(optimizer: torch.optim.Optimizer):
    """What this rank holds: its ZeRO shard's optimizer (both shards' under expert parallelism:
    their groups and state), or the optimizer itself."""
    if isinstance(optimizer, ExpertZero1):
        return optimizer.local()
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
