"""Activation recomputation of a stage's eager blocks, as a schedulable action.

`torch.utils.checkpoint` recomputes inside the backward, so a schedule cannot move the
recomputation elsewhere (Merak's `pre_recompute_1f1b` runs it while the output gradient is still
in flight). This module keeps the autograd graph of a recomputed block but drops the tensors it
saves for backward (a saved-tensor pack hook stores a small handle instead). The `recompute`
action reruns the block on its kept inputs under the same RNG state and collects the tensors the
rerun saves, in the same order; the backward then unpacks the handles into them. Gradients flow
through the one original graph, so results equal those without recomputation.

A segment of `checkpoint_num_layers` consecutive blocks keeps only the first block's inputs: later
blocks of the segment read the (recomputed) output of the block before them.

`in_backward=True` (``recompute_in_backward``) reruns each block inside the backward instead,
when the backward first unpacks one of its handles, and frees the rerun's tensors once the
backward unpacked them all: the stage then holds one recomputed block at a time (as
`torch.utils.checkpoint` does) rather than all of them, and the `recompute` action only marks
the micro-batch. Each block keeps its own inputs (segments of one block).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from merak.recompute.meter import ActivationMeter


@dataclass
class _BlockCall:
    """One recomputed call of one block for one micro-batch."""

    block: nn.Module
    first: bool                    # the first block of its segment
    args: Any                      # pytree of the call's args/kwargs; earlier outputs as _FromBlock
    rng: tuple                     # RNG states at the call
    num_saved: int = 0             # tensors the forward saved for backward (handles handed out)
    saved: list[torch.Tensor] | None = None  # the rerun's saved tensors, once recomputed
    outputs: Any = None            # the rerun's outputs (for the next block of the segment)
    unpacked: int = 0              # in-backward mode: handles the backward took from `saved`
    tokens: list = field(default_factory=list)  # in-backward mode: the meter's holds of `saved`


def _rerun_unpack(_: int) -> torch.Tensor:
    raise RuntimeError("backward through a recomputation's rerun; gradients flow through the "
                       "original forward's graph")


@dataclass(frozen=True)
class _FromBlock:
    """Placeholder in a block's args: leaf `leaf` of the output of call `call` of the segment."""

    call: int
    leaf: int


@dataclass
class _MicroBatchRecord:
    calls: list[_BlockCall] = field(default_factory=list)
    tokens: list[Any] = field(default_factory=list)  # meter tokens of the kept inputs
    recomputed: bool = False
    autocast: Any = None           # in-backward mode: the recompute action's autocast


def recomputed_count(num_blocks: int, ratio: float) -> int:
    """How many of `num_blocks` blocks `ratio` recomputes (rounded half up)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"a recomputation ratio must lie in [0, 1], got {ratio}")
    return int(ratio * num_blocks + 0.5)


def recomputed_blocks(num_blocks: int, ratio: float, segment_size: int) -> list[list[int]]:
    """The segments of block indices a stage recomputes: the first
    `recomputed_count(num_blocks, ratio)` blocks, in segments of `segment_size` consecutive
    blocks."""
    count = recomputed_count(num_blocks, ratio)
    return [list(range(i, min(i + segment_size, count))) for i in range(0, count, segment_size)]


class BlockRecomputation:
    """Drops what segments of `blocks` save and recomputes them when the schedule says so.

    Args:
        blocks: the stage's eager blocks, in call order.
        segments: lists of indices into `blocks` (see `recomputed_blocks`).
        device: the stage's device (its RNG state is saved with the CPU one).
        tp_rng: the model's `TPRandomState`, whose per-rank stream is also replayed.
        meter: counts the kept inputs and recomputed tensors as activations.
        in_backward: rerun each block inside the backward (see the module's docstring).
    """

    def __init__(self, blocks: Sequence[nn.Module], segments: Sequence[Sequence[int]],
                 device: torch.device, tp_rng: Any = None, meter: ActivationMeter | None = None,
                 in_backward: bool = False):
        if in_backward and any(len(s) > 1 for s in segments):
            raise ValueError("recomputation in the backward keeps each block's own inputs: "
                             "segments of one block (checkpoint_num_layers=1)")
        self.device, self.tp_rng, self.meter = device, tp_rng, meter
        self.in_backward = in_backward
        self.current: int | None = None         # micro-batch whose forward is running
        self._records: dict[int, _MicroBatchRecord] = {}
        self._outputs: list[Any] = []           # outputs of the segment's calls in this forward
        self._recomputing: list[torch.Tensor] | None = None
        self.num_blocks = sum(len(s) for s in segments)
        self._restore: list[Callable[[], None]] = []
        for segment in segments:
            for position, index in enumerate(segment):
                self._wrap(blocks[index], first=position == 0)

    @property
    def active(self) -> bool:
        return self.num_blocks > 0

    def _wrap(self, block: nn.Module, first: bool) -> None:
        original = block.forward
        this = weakref.proxy(self)

        def forward(*args, **kwargs):
            return this._call(block, original, first, args, kwargs)

        # the forward in place before (a compiled one, `merak.engine.compile`) comes back
        own = block.__dict__.get("forward")
        block.forward = forward
        self._restore.append(lambda: setattr(block, "forward", own) if own is not None
                             else delattr(block, "forward"))

    def remove(self) -> None:
        """Give the blocks their own forward back."""
        for restore in self._restore:
            restore()
        self._restore = []

    # -- forward --------------------------------------------------------------------------------
    def begin_forward(self, mb: int) -> None:
        self.current = mb if torch.is_grad_enabled() else None
        if self.current is not None:
            self._records[mb] = _MicroBatchRecord()
        self._outputs = []

    def end_forward(self) -> None:
        self.current, self._outputs = None, []

    def _call(self, block: nn.Module, original: Callable, first: bool, args: tuple,
              kwargs: dict) -> Any:
        if self._recomputing is not None:  # a rerun: collect what the block saves
            saved = self._recomputing
            # Detached: a saved tensor keeps its grad_fn, whose graph would keep this list
            # through the hooks, a cycle through C++ that gc cannot see (the stage would leak).
            # The rerun's own graph is never backpropagated; gradients use the original one.
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.append(t.detach()) or len(saved) - 1, _rerun_unpack):
                return original(*args, **kwargs)
        if self.current is None:  # eval, or outside the interpreter
            return original(*args, **kwargs)
        record = self._records[self.current]
        if first:
            self._outputs = []
        leaves, spec = pytree.tree_flatten((args, kwargs))
        produced = {id(t): (c, i) for c, out in enumerate(self._outputs)
                    for i, t in enumerate(pytree.tree_leaves(out)) if isinstance(t, torch.Tensor)}
        kept = [_FromBlock(*produced[id(x)]) if id(x) in produced else x for x in leaves]
        for x in kept:
            if isinstance(x, torch.Tensor) and self.meter is not None:
                record.tokens.append(self.meter.hold(x))
        call = _BlockCall(block, first, pytree.tree_unflatten(kept, spec), self.rng_state())
        record.calls.append(call)
        index = len(record.calls) - 1
        mb = self.current

        def pack(_: torch.Tensor) -> tuple[int, int, int]:
            call.num_saved += 1
            return mb, index, call.num_saved - 1

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            out = original(*args, **kwargs)
        self._outputs.append(out)
        return out

    def _unpack(self, handle: tuple[int, int, int]) -> torch.Tensor:
        mb, index, position = handle
        record = self._records.get(mb)
        if record is None or not record.recomputed:
            raise RuntimeError(f"micro-batch {mb}: backward reached a recomputed block that "
                               f"was not recomputed; the schedule must place 'recompute' of "
                               f"this micro-batch before its backward")
        call = record.calls[index]
        if not self.in_backward:
            return call.saved[position]
        if call.saved is None:  # the first handle of this block the backward asks for
            self._rerun(mb, call, record.autocast)
            call.unpacked = 0
            if self.meter is not None:
                call.tokens = [self.meter.hold(t) for t in call.saved]
        tensor = call.saved[position]
        call.unpacked += 1
        if call.unpacked >= call.num_saved:  # the backward holds what it still needs
            call.saved = None
            for token in call.tokens if self.meter is not None else ():
                self.meter.release(token)
            call.tokens = []
        return tensor

    # -- recompute ------------------------------------------------------------------------------
    def recompute(self, mb: int, autocast: Any = None) -> None:
        """Rerun micro-batch `mb`'s recomputed block calls; their saved tensors are kept for
        its backward."""
        record = self._records.get(mb)
        if record is None:
            raise RuntimeError(f"recompute of micro-batch {mb}, whose forward did not run with "
                               f"recomputation")
        if self.in_backward:  # each block reruns when the backward reaches it
            record.autocast, record.recomputed = autocast, True
            return
        segment_outputs: list[Any] = []
        current = self.rng_state()
        try:
            for call in record.calls:
                leaves, spec = pytree.tree_flatten(call.args)
                if call.first:
                    segment_outputs = []
                leaves = [self._detached(segment_outputs, x) for x in leaves]
                args, kwargs = pytree.tree_unflatten(leaves, spec)
                self.set_rng_state(call.rng)
                call.saved = []
                self._recomputing = call.saved
                try:
                    with torch.enable_grad(), (autocast or nullcontext()):
                        out = call.block(*args, **kwargs)
                finally:
                    self._recomputing = None
                if len(call.saved) != call.num_saved:
                    raise RuntimeError(f"micro-batch {mb}: the recomputed block saved "
                                       f"{len(call.saved)} tensors for backward, its forward "
                                       f"{call.num_saved}; the block's forward must not depend "
                                       f"on state that changes between calls")
                segment_outputs.append(out)
                if self.meter is not None:
                    record.tokens += [self.meter.hold(t) for t in call.saved]
        finally:
            self.set_rng_state(current)
        record.recomputed = True

    def _rerun(self, mb: int, call: _BlockCall, autocast: Any) -> None:
        """In-backward mode: rerun one block call (its own kept inputs) for its saved tensors,
        under the call's RNG state (the backward's own is restored after)."""
        leaves, spec = pytree.tree_flatten(call.args)
        args, kwargs = pytree.tree_unflatten([self._detached([], x) for x in leaves], spec)
        current = self.rng_state()
        self.set_rng_state(call.rng)
        call.saved = []
        self._recomputing = call.saved
        try:
            with torch.enable_grad(), (autocast or nullcontext()):
                call.block(*args, **kwargs)
        finally:
            self._recomputing = None
            self.set_rng_state(current)
        if len(call.saved) != call.num_saved:
            raise RuntimeError(f"micro-batch {mb}: the recomputed block saved {len(call.saved)} "
                               f"tensors for backward, its forward {call.num_saved}; the block's "
                               f"forward must not depend on state that changes between calls")

    @staticmethod
    def _detached(segment_outputs: list[Any], x: Any) -> Any:
        if isinstance(x, _FromBlock):
            x = pytree.tree_leaves(segment_outputs[x.call])[x.leaf]
        if isinstance(x, torch.Tensor):
            return x.detach().requires_grad_(x.requires_grad)
        return x

    def release(self, mb: int) -> None:
        """Forget micro-batch `mb` (after its backward)."""
        record = self._records.pop(mb, None)
        if record is not None and self.meter is not None:
            for token in [*record.tokens, *(t for call in record.calls for t in call.tokens)]:
                self.meter.release(token)

    # -- RNG ------------------------------------------------------------------------------------
    def rng_state(self) -> tuple:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        own = self.tp_rng.own if self.tp_rng is not None else None
        return torch.get_rng_state(), cuda, own

    def set_rng_state(self, state: tuple) -> None:
        cpu, cuda, own = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        if self.tp_rng is not None:
            self.tp_rng.own = own
