"""The token exchange of expert parallelism: an all-to-all with per-peer sizes whose backward
is the reverse all-to-all, so gradients flow back to the ranks the tokens came from.

gloo (CPU) and NCCL both implement ``all_to_all_single`` with split sizes, so one collective
serves both. Every rank of the group must call it the same number of times in the same order:
the forward of each MoE layer calls it twice (tokens out, results back), its backward twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def all_to_all_rows(rows: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``rows[offsets of in_splits[j]]`` to the group's rank j; receive ``out_splits[j]``
    rows from rank j, concatenated in rank order. Differentiable."""
    return _AllToAll.apply(rows, list(out_splits), list(in_splits), group)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`counts` is ``[ep, n]``: row j what this rank sends to rank j; returns ``[ep, n]``: row j
    what rank j sends to this rank (no gradient)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None
