"""Ring attention over the load-balanced split, with its own backward.

Each cp rank holds its queries, keys and values for chunks ``r`` and ``2cp-1-r`` of the row
(`merak.context_parallel.split`). The K/V blocks travel around the ring (``cp - 1`` passes to
the next rank); at each step a rank attends its two query chunks to the two key chunks it
holds, chunk pair by chunk pair: a key chunk before the query chunk in the row is attended
whole, the same chunk under the causal (diagonal) mask, a later chunk not at all (so every rank
does the same work). The partial results merge by their log-sum-exp (online softmax).

The backward is written out rather than left to autograd (which would keep every step's
received K/V and score matrix): the forward keeps only the rank's q, k, v, output and
log-sum-exp; the backward passes the K/V blocks around again, recomputes each block's
probabilities from the saved log-sum-exp, adds the block's dq locally, and sends its dk / dv
along with the K/V block, so after ``cp`` passes each rank holds the gradient of its own keys
and values (the flash-attention backward, distributed).

Block math is computed in fp32 with grouped-query heads expanded (key head ``h // g`` serves
query head ``h``, as HF's ``repeat_kv``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from merak.context_parallel.collectives import RingShift
from merak.context_parallel.split import chunk_ids


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of `_expand`: sum each key head's query-head group."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


def _pairs(cp: int, rank: int, src: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(local query chunk, held key chunk, diagonal) for every chunk pair that is attended when
    this rank holds the K/V of cp rank `src`."""
    mine, theirs = chunk_ids(cp, rank), chunk_ids(cp, src)
    pairs = []
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(theirs):
            if not causal or kc < qc:
                pairs.append((qi, ki, False))
            elif kc == qc:
                pairs.append((qi, ki, True))
    return pairs


def _scores(q, k, scale, diagonal):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:
        n = s.shape[-1]
        upper = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal):
        """q (B, H, 2c, D), k (B, Hkv, 2c, D), v (B, Hkv, 2c, Dv) -> (out (B, H, 2c, Dv))."""
        with torch.autocast(q.device.type, enabled=False):  # fp32 math under mixed precision
            return _RingAttention._forward(ctx, q, k, v, group, scale, causal)

    @staticmethod
    def _forward(ctx, q, k, v, group, scale, causal):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        qf = q.float()
        qs = (qf[:, :, :c], qf[:, :, c:])
        out = [None, None]
        lse = [None, None]
        shift = RingShift(group)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        for step in range(cp):
            if step < cp - 1:
                shift.start(kv)
            src = (rank - step) % cp
            kh, vh = _unpack(kv, k.shape, v.shape)
            kh, vh = _expand(kh.float(), groups), _expand(vh.float(), groups)
            for qi, ki, diagonal in _pairs(cp, rank, src, causal):
                part = slice(ki * c, (ki + 1) * c)
                s = _scores(qs[qi], kh[:, :, part], scale, diagonal)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.matmul(torch.exp(s - block_lse[..., None]), vh[:, :, part])
                if out[qi] is None:
                    out[qi], lse[qi] = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse[qi], block_lse)
                    out[qi] = out[qi] * torch.exp(lse[qi] - merged)[..., None] + \
                        block_out * torch.exp(block_lse - merged)[..., None]
                    lse[qi] = merged
            if step < cp - 1:
                kv = shift.wait()
        out_full = torch.cat(out, dim=2)
        lse_full = torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out_full, lse_full)
        ctx.group, ctx.scale, ctx.causal = group, scale, causal
        return out_full.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, causal = ctx.group, ctx.scale, ctx.causal
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        dout = dout.float()
        delta = (dout * out).sum(-1)  # (B, H, 2c): rowsum(dO * O)
        qf = q.float()
        dq = torch.zeros_like(qf)
        shift, grads_shift = RingShift(group), RingShift(group)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=kv.device)
        for step in range(cp):
            if step < cp - 1:
                shift.start(kv)
            src = (rank - step) % cp
            kh, vh = _unpack(kv, k.shape, v.shape)
            kh, vh = _expand(kh.float(), groups), _expand(vh.float(), groups)
            dk, dv = torch.zeros_like(kh), torch.zeros_like(vh)
            for qi, ki, diagonal in _pairs(cp, rank, src, causal):
                rows, part = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                s = _scores(qf[:, :, rows], kh[:, :, part], scale, diagonal)
                p = torch.exp(s - lse[:, :, rows, None])
                do = dout[:, :, rows]
                dv[:, :, part] += torch.matmul(p.transpose(-1, -2), do)
                ds = p * (torch.matmul(do, vh[:, :, part].transpose(-1, -2))
                          - delta[:, :, rows, None])
                dq[:, :, rows] += torch.matmul(ds, kh[:, :, part]) * scale
                dk[:, :, part] += torch.matmul(ds.transpose(-1, -2), qf[:, :, rows]) * scale
            dkv += torch.cat([_fold(dk, groups).reshape(-1), _fold(dv, groups).reshape(-1)])
            # the K/V gradients travel with their block; after cp passes they are home
            dkv = grads_shift(dkv)
            if step < cp - 1:
                kv = shift.wait()
        dk_own, dv_own = _unpack(dkv, k.shape, v.shape)
        return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype), None, None, None


def _unpack(flat: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return flat[:n].view(k_shape), flat[n:].view(v_shape)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, scale: float, causal: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over the whole row's keys and values, each rank holding
    its load-balanced share: q (B, H, S_local, D), k and v (B, Hkv, S_local, D) -> the output
    (B, H, S_local, Dv). Differentiable."""
    return _RingAttention.apply(q, k, v, group, scale, causal)
