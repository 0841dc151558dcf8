"""Global gradient norm and clipping for a sharded pipeline stage, as `clip_grad_norm_` would
compute on the whole model in one process.

Each logical parameter is counted once: a tensor-parallel shard contributes its own squares;
a parameter replicated over the tp ranks contributes 1/tp on each; a weight tied across k
ranks contributes 1/k on each; dp replicas hold identical (already averaged) gradients, so the
world-wide sum is divided by dp (times cp: context-parallel ranks hold the same weights too),
except for a ZeRO-2/3 shard, which each of those ranks holds a different part of, and an
expert-parallel expert tensor, which only the dp x cp / ep ranks of its edp group hold (counted
ep times on each).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from merak.data_parallel.shards import is_sharded, local
from merak.distributed import liveness
from merak.distributed.parallel_context import ParallelContext
from merak.runtime.hooks import InstructionHook
from merak.stages.stage import InterleavedStage, PipelineStage, stage_placement


class GradNormClipper(InstructionHook):
    """Before each optimizer step: compute the global gradient norm (``last_norm``) and, with
    `max_norm` > 0, scale every gradient by ``min(1, max_norm / (norm + 1e-6))``."""

    def __init__(self, stage: PipelineStage | InterleavedStage, ctx: ParallelContext,
                 max_norm: float):
        self.ctx, self.max_norm = ctx, max_norm
        own = set(getattr(stage, "stage_ids", [ctx.pp_rank]))  # an interleaved rank's chunks
        placement = stage_placement(stage, ctx.pp)
        # a tied weight is one parameter per rank: count the ranks holding it
        tied = {name: len({placement[s] for s in t.stages}) for t in stage.split.tied_weights
                for s, name in t.names if s in own}
        self.weighted: list[tuple[torch.nn.Parameter, float]] = []
        for name, param in stage.named_parameters():
            weight = 1.0 / tied.get(name, 1)
            if getattr(param, "tp_shard", None) is None:
                weight /= ctx.tp
            if is_sharded(param):
                weight *= ctx.replicas
            elif getattr(param, "expert_parallel", False):
                weight *= ctx.ep
            self.weighted.append((param, weight))
        self.last_norm: float | None = None

    def on_instruction_begin(self, name: str, action) -> None:
        if name != "optimizer_step":
            return
        total = self.local_sum_of_squares()
        if self.ctx.world_size > 1:
            with liveness.waiting("the gradient-norm all-reduce"):
                dist.all_reduce(total)
        norm = (total / self.ctx.replicas).sqrt().item()
        self.last_norm = norm
        if self.max_norm > 0:
            coef = min(1.0, self.max_norm / (norm + 1e-6))
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for param, _ in self.weighted:
                if param.grad is not None:
                    grad = local(param.grad)
                    groups.setdefault((grad.device, grad.dtype), []).append(grad)
            for grads in groups.values():
                torch._foreach_mul_(grads, coef)

    @torch.no_grad()
    def local_sum_of_squares(self) -> torch.Tensor:
        """This rank's weighted sum of squared gradients, a one-element fp64 tensor on the
        context's device (what is all-reduced). A ZeRO-2/3 gradient counts its local shard.

        A fixed number of kernels per (device, dtype) group, whatever the number of parameters
        (`clip_grad_norm_`'s approach): one `torch._foreach_norm` of the group (in fp32 for
        bf16/fp16 gradients, so no per-tensor norm is rounded to 8 bits), its norms scaled by
        sqrt(weight) with a scalar list (no host-to-device copy), then squared and summed in
        fp64. Copying every gradient to fp64 first took several kernels and a full-size copy
        per parameter."""
        groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for param, weight in self.weighted:
            if param.grad is None:
                continue
            grad = local(param.grad)
            if grad.numel():  # an empty ZeRO shard adds nothing
                grads, roots = groups.setdefault((grad.device, grad.dtype), ([], []))
                grads.append(grad)
                roots.append(math.sqrt(weight))
        total = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        for (_, dtype), (grads, roots) in groups.items():
            wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
            norms = torch._foreach_mul(torch._foreach_norm(grads, 2.0, dtype=wide), roots)
            squares = torch.stack(norms).double().square().sum()
            total += squares.to(total.device)
        return total
