"""Data-parallel gradient averaging in persistent flat buckets, overlapped with backward
(`GradientAverager`), and the one-off flat all-reduce the step tail uses for tied and
tensor-parallel sums (`launch_all_reduce`, `finish_all_reduce`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Mapping

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
    """Average `.grad` of `params` over `group`, in buckets of about `bucket_bytes`, overlapped
    with the step's last backward.

    Why not torch DDP: its reducer expects every forward to be followed by its own backward,
    while a pipeline stage runs several forwards before their backwards (1F1B, GPipe) and a
    rank may host several stages, so DDP would reduce at the wrong time. The same idea, keyed
    to the schedule instead: each bucket is one persistent flat buffer and its parameters'
    ``.grad`` are views into it (`begin_step` attaches them, zeroed: the optimizer drops grads
    after its step), so backward accumulates straight into the buffer and no gradient is
    copied. While a stage runs the last backward of the step that writes its weights
    (`last_backward`), each gradient that backward completes (a post-accumulate-grad hook)
    counts toward its bucket, and a bucket whose gradients are all final starts its
    all-reduce at once, buckets in a fixed order on every rank (NCCL requires it; buckets
    fill in reverse parameter order, the order backward produces them). `average`, in the
    step's tail, starts what is left and waits for all.

    `late` parameters (weights tied across pipeline ranks, replicated TP weights with partial
    gradients) are summed over other groups in the tail first, so their buckets start only in
    `average`. `predivide` splits the division by the group size into a part before the sum
    and the rest after (DeepSpeed's ``gradient_predivide_factor``; ``prescale_gradients`` is
    predivide = group size), which keeps low-precision sums in range.
    """

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup,
                 bucket_bytes: int = 25 * 2**20, predivide: float = 1.0,
                 late: Iterable[nn.Parameter] = (),
                 stages: Mapping[int, Iterable[nn.Parameter]] | None = None):
        if predivide <= 0:
            raise ValueError(f"predivide must be positive, got {predivide}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.predivide, self.group = predivide, group
        self.params = [p for p in params if p.requires_grad]
        self.world_size = dist.get_world_size(group)
        late_ids = {id(p) for p in late}
        # reversed: backward produces the last layers' gradients first
        early = [p for p in reversed(self.params) if id(p) not in late_ids]
        self.buckets = [_Bucket(b) for b in _buckets(early, bucket_bytes)]
        self.buckets += [_Bucket(b, late=True) for b in _buckets(
            [p for p in reversed(self.params) if id(p) in late_ids], bucket_bytes)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # the stages of this rank holding each parameter (one parameter may serve two)
        self._holders: dict[int, set[int]] = {}
        for stage_id, stage_params in (stages or {}).items():
            for p in stage_params:
                if id(p) in self._bucket_of:
                    self._holders.setdefault(id(p), set()).add(stage_id)
        self._pending: dict[int, set[int]] = {}
        self._armed: int | None = None
        self._phase = "tail"
        self._next = 0  # the next bucket to start
        # this step's bucket starts, in order: (bucket index, "backward" when a gradient hook
        # started it, "after backward" at the end of a closing backward, "tail" in `average`)
        self.launch_log: list[tuple[int, str]] = []
        if self.world_size > 1:  # (a weak reference: an averager replaced leaves no-op hooks)
            this = weakref.ref(self)
            for p in self.params:
                if id(p) in self._holders:
                    p.register_post_accumulate_grad_hook(
                        lambda param, this=this: this() and this()._accumulated(param))

    # -- the step -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before the step's first backward: every gradient a view of its bucket (zeros where
        the optimizer dropped it)."""
        if self.world_size == 1:
            return
        for bucket in self.buckets:
            bucket.attach()
            bucket.final = 0
        self._pending = {k: set(v) for k, v in self._holders.items()}
        self._next, self.launch_log = 0, []

    @contextlib.contextmanager
    def last_backward(self, stage_id: int):
        """Around the last action of the step that writes stage `stage_id`'s weight gradients:
        gradients it completes start their buckets; afterwards all of the stage's are final."""
        if self.world_size == 1 or not self._pending:
            yield
            return
        self._armed = stage_id
        try:
            yield
        finally:
            self._armed = None
        self._phase = "after backward"
        for key, holders in self._pending.items():
            if stage_id in holders:
                holders.discard(stage_id)
                if not holders:
                    self._bucket_of[key].final += 1
        self._launch_ready()

    def _accumulated(self, param: nn.Parameter) -> None:
        holders = self._pending.get(id(param))
        if self._armed is None or holders != {self._armed}:
            return  # not this step's last accumulation into this gradient
        holders.clear()
        self._bucket_of[id(param)].final += 1
        self._phase = "backward"
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready():
            self._start(self._next)

    def _start(self, index: int) -> None:
        self.buckets[index].launch(self.group, self.predivide)
        self.launch_log.append((index, self._phase))
        self._next = index + 1

    def average(self) -> None:
        """The step's tail: start every bucket not started yet, in order, then wait for all and
        divide by what `predivide` left."""
        if self.world_size == 1:
            return
        self._phase = "tail"
        while self._next < len(self.buckets):
            self._start(self._next)
        for bucket in self.buckets:
            bucket.finish(self.world_size / self.predivide)
        self._pending, self._next = {}, 0


class _Bucket:
    """Parameters whose gradients live in one flat buffer (allocated at the first attach)."""

    def __init__(self, params: list[nn.Parameter], late: bool = False):
        self.params, self.late = params, late
        self.numel = sum(p.numel() for p in params)
        self.buffer: torch.Tensor | None = None
        self.final = 0  # gradients final this step
        self.work: dist.Work | None = None

    def views(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self.params:
            out.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def attach(self) -> None:
        """Each gradient a view of the buffer, keeping its value: a missing gradient (the
        optimizer dropped it, or the parameter was not reached) counts as zeros, one held
        elsewhere (set by hand) is copied in.

        At a step's start no gradient is a view yet (the optimizer dropped them all), so the
        whole buffer is zeroed with one kernel rather than one per parameter; only when some
        views already hold this step's values (a gradient replaced after `begin_step`) are
        the missing ones zeroed one by one."""
        if self.buffer is None:
            p = self.params[0]
            self.buffer = torch.empty(self.numel, dtype=p.dtype, device=p.device)
        views = self.views()
        attached = [p.grad is not None and p.grad.data_ptr() == view.data_ptr()
                    and p.grad.shape == view.shape for p, view in zip(self.params, views)]
        whole = not any(attached) and any(p.grad is None for p in self.params)
        if whole:
            self.buffer.zero_()
        for p, view, done in zip(self.params, views, attached):
            if done:
                continue
            if p.grad is not None:
                view.copy_(p.grad)
            elif not whole:
                view.zero_()
            p.grad = view

    def ready(self) -> bool:
        return not self.late and self.final == len(self.params)

    def launch(self, group: dist.ProcessGroup, predivide: float) -> None:
        self.attach()  # a gradient replaced since `begin_step` goes back into the buffer
        if predivide != 1.0:
            self.buffer.div_(predivide)
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True)

    def finish(self, divisor: float) -> None:
        self.work.wait()
        self.work = None
        if divisor != 1:
            self.buffer.div_(divisor)
