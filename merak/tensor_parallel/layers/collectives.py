"""Differentiable collectives over the tensor-parallel group (Megatron's f / g operators).

Each is an `autograd.Function` whose backward is the conjugate collective: identity forward with
all-reduce backward (entering a column-parallel region), all-reduce forward with identity backward
(leaving a row-parallel one), gathers paired with splits, and for sequence parallelism all-gather
paired with reduce-scatter along the sequence dimension.

While torch.export or torch.fx traces a model (to split it into pipeline stages) they do no
communication: the trace only needs each rank's local shapes (gathers and scatters return
stand-ins of the right shape; sequence-parallel pairs keep the full length, consistently), and
the tensor-parallel modules run eagerly inside the stages, where the collectives happen.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from merak.distributed.compat import all_gather_single, reduce_scatter_single


def tracing() -> bool:
    """True while torch.export / TorchDynamo or torch.fx trace the model."""
    return torch.compiler.is_exporting() or is_fx_symbolic_tracing()


def _skip(group: dist.ProcessGroup | None, x: torch.Tensor | None = None) -> bool:
    return group is None or tracing() or dist.get_world_size(group) == 1 \
        or (x is not None and x.is_meta)


def _shapes_only(group, x: torch.Tensor) -> bool:
    """While tracing, or for a meta tensor (a layer another pipeline stage holds, run for its
    shapes during generation: `merak.generation`): shapes, no communication."""
    return group is not None and (tracing() or x.is_meta)


def communicates(group: dist.ProcessGroup | None) -> bool:
    """True when the collectives over `group` really communicate (not while tracing, not over
    one rank or no group)."""
    return not _skip(group)


def all_reduce_async(x: torch.Tensor, group) -> tuple[torch.Tensor, dist.Work]:
    """Start summing `x` over `group` in place of a contiguous copy; returns (that buffer, the
    `Work` to wait on before reading it). For `merak.tensor_parallel.overlap.levels`."""
    x = x.contiguous()
    return x, dist.all_reduce(x, group=group, async_op=True)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The shards of `group` concatenated along `dim`: one `all_gather_single` into one
    buffer (no list of parts and `cat`); along dim 0 that buffer is the result, along another
    dimension one copy moves the shards into place."""
    size, dim = dist.get_world_size(group), dim % x.dim()
    # the concatenated form (gloo has no stacked one): rank r's shard is rows [r*n, (r+1)*n)
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous(), group=group)
    if dim == 0:
        return out
    shape = list(x.shape)
    shape[dim] *= size
    return out.view(size, *x.shape).movedim(0, dim).reshape(shape)


def _check_divisible(x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} into {size} "
                         f"tensor-parallel shards; make it divisible by tp={size}")


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_divisible(x, dim, size)
    return x.chunk(size, dim=dim)[rank].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's shard along `dim` of the sum over `group`: one `reduce_scatter_single`
    (each rank receives only its shard's sum, not the whole sum)."""
    size, dim = dist.get_world_size(group), dim % x.dim()
    _check_divisible(x, dim, size)
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // size, *front.shape[1:]), dtype=x.dtype,
                      device=x.device)
    reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather sequence shards; backward reduce-scatters (sums the ranks' partial grads)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity; backward all-reduces (the input of a column-parallel layer)."""
    return x if _skip(group, x) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce; backward identity (the output of a row-parallel layer)."""
    return x if _skip(group, x) else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather shards along `dim`; backward keeps this rank's slice."""
    if _shapes_only(group, x):  # the gathered shape, for the ops downstream
        return torch.cat([x] * dist.get_world_size(group), dim=dim)
    return x if _skip(group, x) else _GatherFromTP.apply(x, dim, group)


def scatter_to_tp(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Keep this rank's slice along `dim`; backward all-gathers."""
    if _shapes_only(group, x):
        return x.narrow(dim, 0, x.shape[dim] // dist.get_world_size(group))
    return x if _skip(group, x) else _ScatterToTP.apply(x, dim, group)


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sequence parallelism: all-gather sequence shards; backward reduce-scatters."""
    return x if _skip(group, x) else _GatherSequence.apply(x, dim, group)


def reduce_scatter_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sequence parallelism: sum the ranks' partial outputs and keep this rank's sequence
    shard; backward all-gathers."""
    return x if _skip(group, x) else _ReduceScatterSequence.apply(x, dim, group)
