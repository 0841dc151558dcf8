"""Ring attention's blocks against fused attention over the whole row, on one device.

    .venv/bin/python bench/cp_ring_block.py --seq 4096                   # CPU
    python3 bench/cp_ring_block.py --seq 32768 --dtype bfloat16          # one GPU (gpu_check)

One row of `--seq` tokens (8 query heads, 2 key/value heads, head dim 64), forward and backward:

- whole row: ``scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`` (on CUDA the
  flash kernel in bf16 / fp16), time and peak memory (the CUDA allocator's peak; on CPU the
  growth of the process's RSS high-water mark);
- each cp rank's share under ring attention at cp = 2 and 4: the same kernel calls, merges and
  backward calls as `merak.context_parallel.ring` runs on that rank, with the other ranks' K/V
  blocks already on the device (no communication: this measures the blocks' compute and memory,
  which is what a rank adds beside its transfers). Time per rank; peak memory of rank 0.

The ranks' outputs and gradients, put back in row order, are compared with the whole row's
(max abs difference): the check that the block schedule is the row's causal attention.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import RESULTS

from merak.context_parallel.ring import _calls, attend_block, block_gradients
from merak.context_parallel.split import rank_positions

HEADS, KV_HEADS, DIM = 8, 2, 64


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _rss_kib("VmRSS") * 1024


def _peak(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return _rss_kib("VmHWM") * 1024


def _rss_kib(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(field + ":"))
    return int(line.split()[1])


def whole_row(q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def ring_rank(rank, cp, q, k, v, dout, scale):
    """Rank `rank`'s forward and backward of ring attention at `cp`, every K/V block local:
    (its output, its dq, and the dk / dv it adds to each source rank's block)."""
    seq = q.shape[2]
    c = seq // (2 * cp)
    pos = [rank_positions(seq, cp, r, q.device) for r in range(cp)]
    qr, dr = q[:, :, pos[rank]], dout[:, :, pos[rank]]
    blocks = [(k[:, :, pos[r]], v[:, :, pos[r]]) for r in range(cp)]
    out = lse = None
    for step in range(cp):
        src = (rank - step) % cp
        out, lse = attend_block(qr, *blocks[src], _calls(cp, rank, src, True, c), scale, out,
                                lse)
    out = out.to(q.dtype)
    dq = torch.zeros(qr.shape, dtype=torch.float32, device=q.device)
    dkv = {}
    for step in range(cp):
        src = (rank - step) % cp
        dkv[src] = block_gradients(dr, qr, *blocks[src], out, lse,
                                   _calls(cp, rank, src, True, c), scale, dq)
    return out, dq, dkv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--out", default=str(RESULTS / "cp_ring_block.json"),
                        help="write the figures as JSON here (default %(default)s)")
    cli = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, cli.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, HEADS, cli.seq, DIM, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, KV_HEADS, cli.seq, DIM, device=device, dtype=dtype, generator=g)
            for _ in range(2))
    dout = torch.randn_like(q)
    scale = DIM ** -0.5
    whole_row(q[:, :, :256], k[:, :, :256], v[:, :, :256], dout[:, :, :256])  # warm-up
    base = _reset_peak(device)
    start = time.perf_counter()
    ref = whole_row(q, k, v, dout)
    _sync(device)
    figures = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "seq": cli.seq, "dtype": str(dtype).removeprefix("torch."),
               "whole_row": {"seconds": time.perf_counter() - start,
                             "peak_bytes": _peak(device) - base}}
    print(f"{figures['device']}, one row of {cli.seq} tokens, {HEADS} heads / {KV_HEADS} KV "
          f"heads x {DIM}, {figures['dtype']}, forward + backward")
    print(f"whole row (sdpa, causal): {figures['whole_row']['seconds']:.3f} s, peak "
          f"{figures['whole_row']['peak_bytes'] / 2**30:.3f} GiB")
    for cp in (2, 4):
        outs, dqs = {}, {}
        dk, dv = torch.zeros(k.shape, device=device), torch.zeros(v.shape, device=device)
        took, peak = [], 0
        for rank in range(cp):
            base = _reset_peak(device)
            start = time.perf_counter()
            outs[rank], dqs[rank], dkv = ring_rank(rank, cp, q, k, v, dout, scale)
            _sync(device)
            took.append(time.perf_counter() - start)
            if rank == 0:
                peak = _peak(device) - base
            for src, (gk, gv) in dkv.items():
                pos = rank_positions(cli.seq, cp, src, device)
                dk[:, :, pos] += gk
                dv[:, :, pos] += gv
        order = torch.cat([rank_positions(cli.seq, cp, r, device) for r in range(cp)])
        natural = torch.argsort(order)
        out = torch.cat([outs[r] for r in range(cp)], dim=2)[:, :, natural]
        dq = torch.cat([dqs[r] for r in range(cp)], dim=2)[:, :, natural]
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in ((out, ref[0]), (dq, ref[1]), (dk, ref[2]), (dv, ref[3])))
        row = {"seconds_per_rank": max(took), "peak_bytes_rank0": peak, "max_abs_diff": diff}
        figures[f"ring_cp{cp}"] = row
        print(f"ring cp={cp}, per rank: {row['seconds_per_rank']:.3f} s "
              f"({row['seconds_per_rank'] / figures['whole_row']['seconds']:.2f}x the whole "
              f"row), peak {peak / 2**30:.3f} GiB "
              f"({peak / max(figures['whole_row']['peak_bytes'], 1):.2f}x); "
              f"max |diff| vs the whole row {diff:.2e}")
    if cli.out:
        Path(cli.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
