"""The collectives of context parallelism, differentiable where attention needs them.

Only ``all_to_all_single`` is used: gloo (CPU) and NCCL both implement it, with equal or uneven
splits, so Ulysses' exchange of heads for sequence and ring attention's pass of K/V blocks to the
next rank are the same call on both backends. The ring's pass is an all-to-all in which each
rank sends to its successor only (the other splits are empty); being a collective, it never
mixes with the pipeline's point-to-point transfers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()  # (empty_like keeps a strided tensor's strides)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Block ``i`` of dim 0 goes to rank ``i``; block ``i`` of the result came from rank ``i``.
    The exchange is a permutation of blocks that is its own inverse, so its adjoint (the
    backward) is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def scatter_heads_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, H, S_local, D) on each rank -> (B, H / cp, cp * S_local, D): rank ``i`` gets head
    group ``i`` of every rank's tokens, the ranks' tokens concatenated in rank order."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    blocks = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)
    y = _AllToAll.apply(blocks.contiguous(), group)  # (cp, B, H/cp, S_local, D)
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def scatter_sequence_gather_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse exchange for an attention output laid out (B, cp * S_local, H / cp, D):
    -> (B, S_local, H, D), this rank's tokens with every head."""
    cp = dist.get_world_size(group)
    b, s, h, d = x.shape
    blocks = x.reshape(b, cp, s // cp, h, d).transpose(0, 1)
    y = _AllToAll.apply(blocks.contiguous(), group)  # (cp, B, S_local, H/cp, D)
    return y.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * h, d)


class RingShift:
    """Pass a flat tensor to the next rank of `group` and take the previous rank's, as one
    ``all_to_all_single`` (asynchronous: `start`, then `wait`)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._work = None
        self._out: torch.Tensor | None = None

    def start(self, flat: torch.Tensor) -> None:
        flat, cp = flat.contiguous(), self.size
        n = flat.numel()
        send = [n if j == (self.rank + 1) % cp else 0 for j in range(cp)]
        recv = [n if j == (self.rank - 1) % cp else 0 for j in range(cp)]
        self._out = torch.empty_like(flat)
        self._work = dist.all_to_all_single(self._out, flat, recv, send,
                                            group=self.group, async_op=True)

    def wait(self) -> torch.Tensor:
        self._work.wait()
        out, self._out, self._work = self._out, None, None
        return out

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        self.start(flat)
        return self.wait()
