"""Data-parallel gradient averaging in flat buckets.

Why not torch DDP: its reducer expects every forward to be followed by its own backward, while a
pipeline stage runs several forwards before their backwards (1F1B, GPipe), so DDP would reduce
at the wrong time. Gradients are accumulated over all micro-batches and reduced once per step,
launching every bucket's all-reduce asynchronously before waiting on any.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from merak.data_parallel.shards import local


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if current and (size + nbytes > bucket_bytes or param.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def launch_all_reduce(params: list[nn.Parameter], group: dist.ProcessGroup,
                      predivide: float = 1.0) -> tuple[torch.Tensor, dist.Work]:
    """Start summing the grads of `params` (each divided by `predivide` first) over `group` as
    one flat tensor. A missing grad (the parameter was not reached this step) counts as zeros."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    flat = torch.cat([local(p.grad).reshape(-1) for p in params])
    if predivide != 1.0:
        flat.div_(predivide)
    return flat, dist.all_reduce(flat, group=group, async_op=True)


def finish_all_reduce(params: list[nn.Parameter], flat: torch.Tensor, work: dist.Work,
                      divisor: float = 1) -> None:
    """Wait for `launch_all_reduce` and write the (divided) sums back into the grads."""
    work.wait()
    if divisor != 1:
        flat.div_(divisor)
    offset = 0
    for param in params:
        grad = local(param.grad)  # a ZeRO-2/3 shard: this rank's part only
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class GradientAverager:
    """Average `.grad` of `params` over `group`, in buckets of about `bucket_bytes`.

    `predivide` splits the division by the group size into a part before the sum and the rest
    after (DeepSpeed's ``gradient_predivide_factor``; ``prescale_gradients`` is predivide =
    group size), which keeps low-precision sums in range."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup,
                 bucket_bytes: int = 25 * 2**20, predivide: float = 1.0):
        if predivide <= 0:
            raise ValueError(f"predivide must be positive, got {predivide}")
        self.predivide = predivide
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.buckets = _buckets(self.params, bucket_bytes)

    def average(self) -> None:
        if self.world_size == 1:
            return
        launched = [launch_all_reduce(bucket, self.group, self.predivide)
                    for bucket in self.buckets]
        for bucket, (flat, work) in zip(self.buckets, launched):
            finish_all_reduce(bucket, flat, work, divisor=self.world_size / self.predivide)
