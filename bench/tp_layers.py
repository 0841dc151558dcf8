"""Megatron-style TP layers (ours) against DTensor's `parallelize_module`, on CPU/gloo.

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/tp_layers.py

The same column -> row MLP pair (hidden 512 -> 2048 -> 512, batch 8 x 128), sharded both ways
from one seeded module; checks both match the unsharded module, then times forward + backward
(median of 20 after 3 warm-ups) and prints DTensor time / ours. This is the measurement behind
the choice written in `merak/tensor_parallel/layers/megatron.py`.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import merak
from merak.tensor_parallel.layers.megatron import make_column_parallel_, make_row_parallel_

HIDDEN, FFN, BATCH, SEQ, REPEATS = 512, 2048, 8, 128, 20


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def timed(module: nn.Module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for i in range(REPEATS + 3):
        dist.barrier()
        start = time.perf_counter()
        out = module(x)
        out.sum().backward()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    torch.set_num_threads(1)
    ctx = merak.init(dp=1, tp=int(os.environ["WORLD_SIZE"]), pp=1)
    torch.manual_seed(0)
    reference = MLP()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    expected = reference(x)

    ours = copy.deepcopy(reference)
    make_column_parallel_(ours.up, "up", ctx.tp_group, ctx.tp_rank, ctx.tp)
    make_row_parallel_(ours.down, "down", ctx.tp_group, ctx.tp_rank, ctx.tp)
    theirs = parallelize_module(copy.deepcopy(reference), ctx.mesh["tp"],
                                {"up": ColwiseParallel(), "down": RowwiseParallel()})
    ours_s, ours_out = timed(ours, x)
    theirs_s, theirs_out = timed(theirs, x)
    theirs_out = theirs_out.full_tensor() if hasattr(theirs_out, "full_tensor") else theirs_out
    torch.testing.assert_close(ours_out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(theirs_out, expected, rtol=1e-4, atol=1e-5)
    if ctx.rank == 0:
        print(f"tp={ctx.tp}, MLP {HIDDEN}->{FFN}->{HIDDEN}, batch {BATCH}x{SEQ}, fwd+bwd median")
        print(f"  merak Megatron-style layers  {ours_s * 1e3:7.2f} ms")
        print(f"  DTensor parallelize_module   {theirs_s * 1e3:7.2f} ms")
        print(f"  DTensor / merak              {theirs_s / ours_s:7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
