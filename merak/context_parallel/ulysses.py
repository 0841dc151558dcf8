"""Ulysses attention: an all-to-all gives each cp rank 1/cp of the heads over the whole row, the
model's own attention implementation runs on it, a second all-to-all returns the rank's tokens
with every head.

Any key/value head count: where cp does not divide the key/value heads on the rank (few heads
under grouped-query attention, or tensor parallelism already dividing them), each key/value head
is repeated ``r = cp / gcd(heads_kv, cp)`` times before the exchange (as DeepSpeed's Ulysses
does). ``r`` divides the query-head group size whenever cp divides the query heads, so query
head ``j`` keeps its key head; the repeat's backward sums the copies' gradients.

No mask of the whole row (S x S) is built. The implementation runs on the whole row with its
own causal flag where it has one (sdpa, flash) and the window passed to the kernel (flash);
otherwise (eager, or a sliding window under sdpa) it runs over query blocks of `block_size`
rows, each over only the keys it can see, with that block's mask (cached: every interior block
of a window has the same one).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from merak.context_parallel.collectives import (
    scatter_heads_gather_sequence,
    scatter_sequence_gather_heads,
)
from merak.context_parallel.split import gathered_positions


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated so that cp divides them (1: none)."""
    return cp // math.gcd(kv_heads, cp)


def check_heads(heads: int, cp: int, family: str, module_name: str) -> None:
    if heads % cp:
        raise ValueError(
            f"cp_mode='ulysses' gives each of the cp={cp} ranks 1/cp of the attention heads, "
            f"but the {family} family's {module_name} has {heads} query heads on this rank "
            f"(after tensor parallelism): choose cp (and tp) so that cp x tp divides the query "
            f"heads, or cp_mode='ring' (any head count)")


def ulysses_attention(module, query, key, value, group: dist.ProcessGroup, inner, mask_kind,
                      scaling: float, dropout: float, causal: bool, window: int | None,
                      passed: dict, block_size: int) -> torch.Tensor:
    """This rank's tokens' attention output (B, S_local, H, D) for q (B, H, S_local, D) and
    k, v (B, Hkv, S_local, D). `inner` is the wrapped registry function; `mask_kind` "flash",
    "sdpa" or "eager" (how it takes causality and masks)."""
    cp = dist.get_world_size(group)
    repeats = kv_repeats(key.shape[1], cp)
    if repeats > 1:
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    seq_len = query.shape[2] * cp
    order = gathered_positions(seq_len, cp, query.device)
    natural = torch.argsort(order)
    q, k, v = (scatter_heads_gather_sequence(t, group).index_select(2, natural)
               for t in (query, key, value))
    passed = dict(passed)
    passed.pop("sliding_window", None)
    if repeats > 1:  # the implementation repeats each key head over its (now smaller) group
        module = _Regrouped(module, query.shape[1] // key.shape[1])
    if mask_kind == "flash" or (mask_kind == "sdpa" and window is None) or \
            (not causal and window is None):
        if window is not None:
            passed["sliding_window"] = window
        out, _ = inner(module, q, k, v, None, scaling=scaling, dropout=dropout, **passed)
    else:
        out = _blocked(module, q, k, v, inner, mask_kind, scaling, dropout, causal, window,
                       passed, block_size)
    out = out.index_select(1, order)  # (B, S, H / cp, D) in the ranks' order
    return scatter_sequence_gather_heads(out.contiguous(), group)


class _Regrouped:
    """`module` as the wrapped implementation sees it after the key/value heads were repeated:
    its ``num_key_value_groups`` (how many query heads share a key head, which HF's
    implementations read to repeat them) divided by the repeats."""

    def __init__(self, module, groups: int):
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _blocked(module, q, k, v, inner, mask_kind, scaling, dropout, causal, window, passed,
             block_size):
    """`inner` over query blocks, each over the keys it sees, with its (cached) block mask."""
    seq_len = q.shape[2]
    outs = []
    for start in range(0, seq_len, block_size):
        end = min(start + block_size, seq_len)
        k_start = max(0, start - window + 1) if window is not None else 0
        k_end = end if causal else seq_len
        mask = block_mask(end - start, k_end - k_start, start - k_start, causal, window,
                          mask_kind, q.dtype, q.device)
        out, _ = inner(module, q[:, :, start:end], k[:, :, k_start:k_end],
                       v[:, :, k_start:k_end], mask, scaling=scaling, dropout=dropout, **passed)
        outs.append(out)
    return torch.cat(outs, dim=1)


@functools.lru_cache(maxsize=4)
def block_mask(rows: int, cols: int, offset: int, causal: bool, window: int | None,
               mask_kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (1, 1, rows, cols) mask of query rows ``offset + i`` (relative to the first key)
    over keys ``j``: allowed where ``j <= offset + i`` (causal) and ``offset + i - j <
    window``; boolean for sdpa, additive (0 / dtype's min) for eager."""
    i = torch.arange(rows, device=device)[:, None] + offset
    j = torch.arange(cols, device=device)[None, :]
    allowed = torch.ones(rows, cols, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= i - j < window
    allowed = allowed[None, None]
    if mask_kind == "sdpa":
        return allowed
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
