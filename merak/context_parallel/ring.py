"""Ring attention over the load-balanced split, on fused kernels, with its own backward.

Each cp rank holds its queries, keys and values for chunks ``r`` and ``2cp-1-r`` of the row
(`merak.context_parallel.split`). The K/V blocks travel around the ring (``cp - 1`` passes to
the next rank); at each step a rank attends its queries to the K/V block it holds. Under causal
attention the load-balanced layout makes every step one fused-kernel call (`_calls`):

- its own block: causal attention over its two chunks (chunk ``r`` precedes ``2cp-1-r``);
- the block of a rank ``src < r``: every query over the block's first chunk (``src < r``) and
  none over its second (``2cp-1-src > 2cp-1-r``);
- the block of a rank ``src > r``: the second query chunk over both key chunks (both precede
  it), the first over neither,

so every rank does the same work at every step. The kernels (`merak.context_parallel.kernels`)
run in the input dtype and return each block's log-sum-exp; partial outputs merge by it in
fp32. No (query x key) matrix exists anywhere.

The backward is written out rather than left to autograd (which would keep every step's
received K/V): the forward keeps only the rank's q, k, v, its output and log-sum-exp; the
backward passes the K/V blocks around again, runs each block's fused backward with the final
output and log-sum-exp, adds the block's dq locally and sends the block's dK/dV (in the input
dtype, accumulated in fp32 on each rank) one step behind the K/V, so that pass overlaps the next
block's compute; after ``cp`` passes each rank holds the gradient of its own keys and values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from merak.context_parallel.collectives import RingShift
from merak.context_parallel.kernels import block_backward, block_forward

_ALL = slice(None)


def _calls(cp: int, rank: int, src: int, causal: bool,
           c: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) of the kernel calls of rank `rank` holding the K/V block
    of cp rank `src`; each of the two holds 2 chunks of `c` tokens."""
    if not causal:
        return [(_ALL, _ALL, False)]
    if src == rank:
        return [(_ALL, _ALL, True)]
    if src < rank:
        return [(_ALL, slice(0, c), False)]
    return [(slice(c, 2 * c), _ALL, False)]


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running fp32 (out, lse), in place (online softmax)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged)[..., None])
    out.add_(block_out.float() * torch.exp(block_lse - merged)[..., None])
    lse.copy_(merged)


def attend_block(q, kh, vh, calls, scale, out, lse):
    """Fold the attention of `q` over one K/V block (its kernel `calls`, `_calls`) into the
    running fp32 (`out`, `lse`); None before the first block. Returns them."""
    for rows, keys, diagonal in calls:
        block_out, block_lse = block_forward(q[:, :, rows], kh[:, :, keys], vh[:, :, keys],
                                             scale, diagonal)
        if out is None:  # the rank's own block comes first and covers every query
            out, lse = block_out.float(), block_lse.float()
        else:
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    return out, lse


def block_gradients(dout, q, kh, vh, out, lse, calls, scale, dq):
    """One K/V block's share of the backward: adds its dq into `dq` (fp32) and returns the
    block's (dK, dV) in fp32, given the final output `out` and log-sum-exp `lse`."""
    dk = torch.zeros(kh.shape, dtype=torch.float32, device=kh.device)
    dv = torch.zeros(vh.shape, dtype=torch.float32, device=vh.device)
    for rows, keys, diagonal in calls:
        dq_b, dk_b, dv_b = block_backward(
            dout[:, :, rows].contiguous(), q[:, :, rows], kh[:, :, keys], vh[:, :, keys],
            out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), scale, diagonal)
        dq[:, :, rows] += dq_b
        dk[:, :, keys] += dk_b
        dv[:, :, keys] += dv_b
    return dk, dv


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return flat[:n].view(k_shape), flat[n:].view(v_shape)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal):
        """q (B, H, 2c, D), k (B, Hkv, 2c, D), v (B, Hkv, 2c, Dv) -> out (B, H, 2c, Dv)."""
        with torch.autocast(q.device.type, enabled=False):  # the kernels take the input dtype
            ctx.kv_dtypes = k.dtype, v.dtype
            k, v = k.to(q.dtype), v.to(q.dtype)
            return _RingAttention._forward(ctx, q, k, v, group, scale, causal)

    @staticmethod
    def _forward(ctx, q, k, v, group, scale, causal):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        out = lse = None
        shift = RingShift(group)
        kv = _pack(k, v)
        for step in range(cp):
            if step < cp - 1:
                shift.start(kv)
            src = (rank - step) % cp
            kh, vh = _unpack(kv, k.shape, v.shape)
            out, lse = attend_block(q, kh, vh, _calls(cp, rank, src, causal, c), scale, out,
                                    lse)
            if step < cp - 1:
                kv = shift.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.causal = group, scale, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, causal = ctx.group, ctx.scale, ctx.causal
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        dout = dout.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        shift, grads = RingShift(group), RingShift(group)
        kv = _pack(k, v)
        for step in range(cp):
            if step < cp - 1:
                shift.start(kv)
            src = (rank - step) % cp
            kh, vh = _unpack(kv, k.shape, v.shape)
            dk, dv = block_gradients(dout, q, kh, vh, out, lse,
                                     _calls(cp, rank, src, causal, c), scale, dq)
            dkv = _pack(dk, dv)
            if step > 0:  # what the ranks before added to this block's gradients
                dkv += grads.wait()
            grads.start(dkv.to(q.dtype))  # it follows its block, one step behind
            if step < cp - 1:
                kv = shift.wait()
        dk_own, dv_own = _unpack(grads.wait(), k.shape, v.shape)
        k_dtype, v_dtype = ctx.kv_dtypes
        return dq.to(q.dtype), dk_own.to(k_dtype), dv_own.to(v_dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, scale: float, causal: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over the whole row's keys and values, each rank holding
    its load-balanced share: q (B, H, S_local, D), k and v (B, Hkv, S_local, D) -> the output
    (B, H, S_local, Dv). Differentiable."""
    return _RingAttention.apply(q, k, v, group, scale, causal)
