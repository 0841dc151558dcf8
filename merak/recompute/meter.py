"""Measure a stage's activation memory: the bytes kept alive for backward.

CPU tensors have no allocator statistics, and on a GPU the caching allocator mixes activations
with parameters, gradients and optimizer state. This meter counts exactly what recomputation and
schedules change: every tensor the autograd graph saves for backward (through a saved-tensor
pack hook) and every tensor recomputation keeps (its kept inputs, its recomputed tensors), each
storage once, parameters excluded. The live total rises with forwards and recomputations and
falls as backwards free graphs; its maximum over a step is the stage's peak activation memory,
the quantity the simulator's memory model predicts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor


class _Held:
    """A saved tensor wrapped by the pack hook; releases its bytes when the graph drops it."""

    __slots__ = ("meter", "tensor", "token")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor):
        # Detached: an op that saves its own output (log_softmax) would otherwise hold its node
        # through this wrapper, a cycle through autograd's C++ graph that gc cannot collect; a
        # zero-bubble weight pass never frees such a node's saved tensors, so it leaked.
        self.tensor, self.meter = tensor.detach(), meter
        self.token = meter.hold(tensor)

    def __del__(self) -> None:
        self.meter.release(self.token)


class ActivationMeter:
    """Live and peak bytes of the activations a stage keeps for backward.

    Args:
        parameters: tensors never counted (the stage's parameters and buffers).
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        # a ZeRO-2/3 (FSDP2) parameter is a DTensor, which has no storage of its own: its
        # local shard's is the one to exclude
        self._excluded = {self._key(p.to_local() if isinstance(p, DTensor) else p)
                          for p in parameters}
        self._count: dict[tuple, int] = {}
        self._bytes: dict[tuple, int] = {}
        self.live = 0
        self.peak = 0

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        storage = tensor.untyped_storage()
        return tensor.device.type, storage.data_ptr()

    def hold(self, tensor: torch.Tensor) -> tuple | None:
        """Count `tensor`'s storage (once, however many hold it); returns a release token."""
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return None
        key = self._key(tensor)
        if key in self._excluded or key[1] == 0:
            return None
        if key not in self._count:
            self._count[key] = 0
            self._bytes[key] = tensor.untyped_storage().nbytes()
            self.live += self._bytes[key]
            self.peak = max(self.peak, self.live)
        self._count[key] += 1
        return key

    def release(self, token: tuple | None) -> None:
        if token is None or token not in self._count:
            return
        self._count[token] -= 1
        if self._count[token] == 0:
            del self._count[token]
            self.live -= self._bytes.pop(token)

    def reset_peak(self) -> None:
        self.peak = self.live

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Count what autograd saves inside the block (innermost saved-tensor hooks win, so
        recomputed blocks report theirs through `hold` instead)."""
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(self, t),
                                                      lambda held: held.tensor):
            yield
