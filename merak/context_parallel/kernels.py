"""The fused attention kernels ring attention runs each block on: forward returning the block's
log-sum-exp, backward from a given output and log-sum-exp, in the input dtype.

PyTorch's public ``scaled_dot_product_attention`` does not return the log-sum-exp that merging
partial results needs, so the blocks call the ATen kernels behind it (the same ones
``torch.nn.attention`` dispatches to; ring-attention implementations for flash-attn do the same):

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (any float dtype; grouped key/value heads
  natively, forward and backward);
- CUDA, fp16 / bf16: ``_scaled_dot_product_flash_attention`` (key/value heads expanded to the
  query heads in the input dtype, as a view where they already match);
- CUDA, fp32: ``_scaled_dot_product_efficient_attention`` (its log-sum-exp padded to a multiple
  of 32 rows, cut here and padded back for its backward).

No kernel materializes a (query x key) matrix: memory is linear in the block's length. The
backward takes the FINAL output and log-sum-exp of the merged attention (not the block's own):
with them the block's probabilities and ``rowsum(dO * O)`` are those of the whole row, so the
block's gradients are its share of the exact gradients (the flash-attention backward, split).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ops = torch.ops.aten
_EFFICIENT_LSE_ROWS = 32


def _kind(q: torch.Tensor) -> str:
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda":
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) else "efficient"
    raise NotImplementedError(
        f"ring attention has fused block kernels for CPU and CUDA, not for {q.device.type} "
        f"tensors: use cp_mode='ulysses' on this device")


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to `heads` query heads (key head ``h // g`` serves query head
    ``h``, as HF's ``repeat_kv``), in x's dtype."""
    b, h, s, d = x.shape
    if h == heads:
        return x
    return x[:, :, None].expand(b, h, heads // h, s, d).reshape(b, heads, s, d)


def _fold(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The adjoint of `_expand`: each key head's gradient summed over its query-head group."""
    b, h, s, d = grad.shape
    if h == heads:
        return grad
    return grad.view(b, heads, h // heads, s, d).sum(2)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H, Lq, D) over k, v (B, Hkv, Lk, D) -> (out (B, H, Lq, Dv) in q's
    dtype, lse (B, H, Lq) in fp32). `causal` masks key j > query i (top-left aligned)."""
    kind = _kind(q)
    if kind == "cpu":
        out, lse = _ops._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse
    heads = q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    if kind == "flash":
        out, lse, *_ = _ops._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    out, lse, _, _ = _ops._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]]


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v (k and v with their own head count) for one block, given the
    merged attention's output `out` and log-sum-exp `lse` for these queries."""
    kind = _kind(q)
    if kind == "cpu":
        return _ops._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    hkv, heads = k.shape[1], q.shape[1]
    ke, ve = _expand(k, heads), _expand(v, heads)
    if kind == "flash":
        # the nested-tensor and dropout arguments of the dense, dropout-free case
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = _ops._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, empty, empty, q.shape[2], k.shape[2], 0.0, causal,
            empty, empty, scale=scale)
    else:
        rows = -(-q.shape[2] // _EFFICIENT_LSE_ROWS) * _EFFICIENT_LSE_ROWS
        padded = F.pad(lse, (0, rows - lse.shape[-1]))
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _ops._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, padded, seed, seed, 0.0, [True, True, True, False],
            causal, scale=scale)
    return dq, _fold(dk, hkv), _fold(dv, hkv)
