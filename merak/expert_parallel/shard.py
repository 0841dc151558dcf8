"""`shard_experts`: split every MoE experts module of a model (or pipeline stage) over the
expert-parallel group, and route it through the expert-parallel implementation.

An experts module is one transformers' ``use_experts_implementation`` decorated (Qwen3-MoE,
Mixtral, ... : merged 3-D ``gate_up_proj`` / ``down_proj`` tensors, ``[num_experts, ...]``,
optional biases). ep rank r keeps experts ``[r*E/ep, (r+1)*E/ep)`` of each of them; its
parameters are marked ``expert_parallel`` so the interpreter reduces their gradients over the
expert-data-parallel group (`ParallelContext.edp_group`) rather than over all replicas, and
carry ``ep_shard`` (`ExpertSlice`): which experts of the layer's whole tensor they hold, so
checkpoints write each expert once and exports put the layer back together.

With tensor parallelism the experts module was split first (`merak.tensor_parallel`, the
``moe_tp_experts`` style: every expert's intermediate dim over the tp ranks, ``param.tp_shard``),
so ep rank r keeps its experts of its tp shard: ``1/(ep*tp)`` of the layer's tensor. Its
`ExpertSlice` then carries the TP cut too (``tp``), and ``param.tp_shard`` becomes the TP cut
of the rank's experts (its ``full_shape`` ``[E/ep, ...]``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from merak import lora
from merak.distributed.parallel_context import ParallelContext
from merak.expert_parallel.dense_moe import dense_moe_blocks, route_block
from merak.expert_parallel.dispatch import IMPLEMENTATION, ExpertShard, register


@dataclass(frozen=True)
class ExpertSlice:
    """An expert-parallel shard of a per-expert tensor (``param.ep_shard``): ep rank `rank` of
    `size` holds experts ``[rank*E/size, (rank+1)*E/size)`` along dimension 0 of the layer's
    whole tensor (`full_shape`, E = ``full_shape[0]``). It reads as a tensor-parallel
    `ShardSpec` of one part along dimension 0 (`dim`, `chunks`, `take`, `assemble`), so the
    checkpoint and export code describe and put back both kinds alike.

    `tp`: with tensor parallelism splitting the experts too, the TP `ShardSpec` of this rank's
    experts (its ``full_shape`` ``[E/size, ...]``, its `dim` not 0): the rank holds that cut of
    them. Every (ep rank, tp rank) then holds its own piece: `part` of `parts`, ep-major."""

    rank: int
    size: int
    full_shape: tuple[int, ...]
    dim: int = 0
    tp: object | None = None  # a `merak.tensor_parallel` ShardSpec, or None

    @property
    def chunks(self) -> tuple[int, ...]:
        return (self.full_shape[0],)

    @property
    def part(self) -> int:
        """This rank's piece among `parts` (ep rank, then tp rank)."""
        return self.rank if self.tp is None else self.rank * self.tp.size + self.tp.rank

    @property
    def parts(self) -> int:
        return self.size if self.tp is None else self.size * self.tp.size

    @property
    def rows(self) -> tuple[int, int]:
        """The experts ``[first, end)`` this rank holds: the rows of dimension 0 of the whole
        tensor it is cut from (a checkpoint loader reads only those, `take_rows` the rest)."""
        per = self.full_shape[0] // self.size
        return self.rank * per, (self.rank + 1) * per

    def take_rows(self, mine: torch.Tensor) -> torch.Tensor:
        """This rank's piece from its experts' rows of the whole tensor (its TP cut of them)."""
        return mine if self.tp is None else self.tp.take(mine)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return self.take_rows(full.chunk(self.size, dim=0)[self.rank])

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The layer's whole tensor from every piece (`part` order: ep rank, then tp rank)."""
        if self.tp is not None:
            per = self.tp.size
            shards = [self.tp.assemble(shards[r * per:(r + 1) * per]) for r in range(self.size)]
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


def refuse_expert_adapters(model: nn.Module, ep: int) -> None:
    """Refuse LoRA adapters on expert weights with ep > 1 (peft's ``target_parameters`` on an
    experts module, or any adapter layer inside one): one adapter over all of a layer's experts
    would hold every expert's rows on each rank, which `shard_experts` does not split.
    Adapters elsewhere (attention, shared experts, the router) compose with ep."""
    if ep == 1:
        return
    from merak.rules import NotSupportedYetError

    experts = set(experts_modules(model))
    for name, module in model.named_modules():
        if not lora.is_lora_layer(module):
            continue
        base = lora.base_layer(module)
        inside = any(name == e or name.startswith(e + ".") for e in experts)
        if inside or is_experts_module(base):
            raise NotSupportedYetError(
                f"LoRA adapters on expert weights ({name}, {type(module).__name__}) with expert "
                f"parallelism (ep={ep}) are not supported yet: an adapter over a layer's "
                f"experts is not split over the ep ranks; target the attention and other "
                f"non-expert linears (leave the experts out of target_modules and "
                f"target_parameters), or use ep=1")


def _check_tp_cuts(modules: dict[str, nn.Module]) -> None:
    """A per-expert tensor tensor parallelism split along the expert dim (dim 0) cannot be
    split over ep as well."""
    for name, module in modules.items():
        for pname, param in _per_expert(module, module.num_experts).items():
            spec = getattr(param, "tp_shard", None)
            if spec is not None and spec.dim == 0:
                raise ValueError(
                    f"expert parallelism: {name}.{pname} is split by tensor parallelism along "
                    f"its expert dim (dim 0), which expert parallelism splits; give it a TP "
                    f"style along another dim (merak.set_tp_layer_lists / "
                    f"MerakArguments(tp_plan=...)) or use tp=1")


def shard_experts(model: nn.Module, ctx: ParallelContext) -> dict[str, tuple[int, int]]:
    """Keep this ep rank's experts of every experts module of `model` and dispatch them through
    the expert-parallel implementation. Returns ``{module name: (first expert, count)}``
    (empty when ``ctx.ep == 1``: nothing changes).

    `model` may be on the meta device: its experts tensors then become meta tensors of this
    rank's experts (carrying ``ep_shard``), so a checkpoint loader reads only those rows
    (`merak.parallelize` does this before loading a stage). Modules sharded already (by an
    earlier call) are left as they are.

    Raises:
        ValueError: ep does not divide some module's number of experts (before any change).
    """
    if ctx.ep == 1:
        return {}
    found = experts_modules(model)
    done = {name: (m.merak_ep.first, m.merak_ep.local) for name, m in found.items()
            if getattr(m, "merak_ep", None) is not None}
    modules = {n: m for n, m in found.items() if n not in done}
    check_divisible(modules, ctx.ep)
    refuse_expert_adapters(model, ctx.ep)
    _check_tp_cuts(modules)
    register()
    inner_of: dict[int, str | None] = {}  # per config object: the implementation it had
    dense = {f"{name}.experts": block for name, block in dense_moe_blocks(model).items()}
    kept = dict(done)
    for name, module in modules.items():
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
            tp = getattr(param, "tp_shard", None)
            if tp is None:
                local.ep_shard = ExpertSlice(ctx.ep_rank, ctx.ep, tuple(param.shape))
            else:  # the TP cut of this rank's experts
                local.tp_shard = replace(tp, full_shape=(shard.local, *tp.full_shape[1:]),
                                         source_key=None)
                local.ep_shard = ExpertSlice(ctx.ep_rank, ctx.ep, tuple(tp.full_shape),
                                             tp=local.tp_shard)
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
