"""`shard_experts`: split every MoE experts module of a model (or pipeline stage) over the
expert-parallel group, and route it through the expert-parallel implementation.

An experts module is one transformers' ``use_experts_implementation`` decorated (Qwen3-MoE,
Mixtral, ... : merged 3-D ``gate_up_proj`` / ``down_proj`` tensors, ``[num_experts, ...]``,
optional biases). ep rank r keeps experts ``[r*E/ep, (r+1)*E/ep)`` of each of them; its
parameters are marked ``expert_parallel`` so the interpreter reduces their gradients over the
expert-data-parallel group (`ParallelContext.edp_group`) rather than over all replicas, and
carry ``ep_shard`` (`ExpertSlice`): which experts of the layer's whole tensor they hold, so
checkpoints write each expert once and exports put the layer back together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from merak.distributed.parallel_context import ParallelContext
from merak.expert_parallel.dense_moe import dense_moe_blocks, route_block
from merak.expert_parallel.dispatch import IMPLEMENTATION, ExpertShard, register


@dataclass(frozen=True)
class ExpertSlice:
    """An expert-parallel shard of a per-expert tensor (``param.ep_shard``): ep rank `rank` of
    `size` holds experts ``[rank*E/size, (rank+1)*E/size)`` along dimension 0 of the layer's
    whole tensor (`full_shape`, E = ``full_shape[0]``). It reads as a tensor-parallel
    `ShardSpec` of one part along dimension 0 (`dim`, `chunks`, `take`, `assemble`), so the
    checkpoint and export code describe and put back both kinds alike."""

    rank: int
    size: int
    full_shape: tuple[int, ...]
    dim: int = 0

    @property
    def chunks(self) -> tuple[int, ...]:
        return (self.full_shape[0],)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.size, dim=0)[self.rank]

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The layer's whole tensor from every ep rank's shard (ep rank order)."""
        return torch.cat(shards, dim=0)


def is_experts_module(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts module (``use_experts_implementation``)."""
    return hasattr(module, "_is_expert_parallel") and isinstance(
        getattr(module, "num_experts", None), int) and hasattr(module, "config")


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every experts module of `model`: transformers' experts-interface modules and the
    ``experts`` of the blocks `merak.expert_parallel.dense_moe` routes (Llama-4)."""
    found = {name: m for name, m in model.named_modules() if is_experts_module(m)}
    found.update({f"{name}.experts": block.experts
                  for name, block in dense_moe_blocks(model).items()})
    return found


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters `shard_experts` split (their gradients are reduced over edp)."""
    return [p for p in model.parameters() if getattr(p, "expert_parallel", False)]


def _per_expert(module: nn.Module, num_experts: int) -> dict[str, nn.Parameter]:
    """The module's own parameters indexed by expert (first dimension num_experts)."""
    return {name: p for name, p in module.named_parameters(recurse=False)
            if p.dim() >= 2 and p.shape[0] == num_experts}


def check_divisible(modules: dict[str, nn.Module], ep: int) -> None:
    for name, module in modules.items():
        if module.num_experts % ep:
            raise ValueError(
                f"expert parallelism: {name} ({type(module).__name__}) has "
                f"{module.num_experts} experts, which ep={ep} does not divide; choose an ep "
                f"that divides {module.num_experts} (merak.init(ep=))")


def shard_experts(model: nn.Module, ctx: ParallelContext) -> dict[str, tuple[int, int]]:
    """Keep this ep rank's experts of every experts module of `model` and dispatch them through
    the expert-parallel implementation. Returns ``{module name: (first expert, count)}``
    (empty when ``ctx.ep == 1``: nothing changes).

    Raises:
        ValueError: ep does not divide some module's number of experts (before any change).
    """
    if ctx.ep == 1:
        return {}
    modules = experts_modules(model)
    check_divisible(modules, ctx.ep)
    register()
    inner_of: dict[int, str | None] = {}  # per config object: the implementation it had
    dense = {f"{name}.experts": block for name, block in dense_moe_blocks(model).items()}
    kept = {}
    for name, module in modules.items():
        if getattr(module, "merak_ep", None) is not None:
            raise ValueError(f"expert parallelism: {name} is sharded already")
        config = getattr(module, "config", None)
        if name not in dense and id(config) not in inner_of:
            inner_of[id(config)] = config._experts_implementation
        shard = ExpertShard(ctx.ep_group, ctx.ep, ctx.ep_rank, module.num_experts,
                            inner_of.get(id(config)))
        lo, hi = shard.first, shard.first + shard.local
        for pname, param in _per_expert(module, module.num_experts).items():
            local = nn.Parameter(param.detach()[lo:hi].clone(),
                                 requires_grad=param.requires_grad)
            local.expert_parallel = True
            local.ep_shard = ExpertSlice(ctx.ep_rank, ctx.ep, tuple(param.shape))
            setattr(module, pname, local)
        module.num_experts = shard.local
        module.merak_ep = shard
        if name in dense:
            route_block(dense[name], shard)
        kept[name] = (lo, shard.local)
    for name, module in modules.items():
        if name not in dense:
            module.config._experts_implementation = IMPLEMENTATION
    return kept
