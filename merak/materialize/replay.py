"""Replaying a meta build's init record (`merak.materialize.record`) into real tensors.

The record is the build's sequence of ATen ops on tracked tensors: meta ones, and real ones whose
values in the build are not the eager build's (drawn at random after meta draws had left the
generator behind, or computed from such: tainted). Each tracked tensor is named by a `Ref`: the
key of its storage and its view of it. An op either writes its target in place (``uniform_``,
``copy_``, ``log_``) or makes new storages out of place (``log(A)``, ``rand(n)``,
``pad(bias)``); views (``w[0]``, ``A[None]``) make no op, their `Ref`s address their base's
storage. So an init that reads values (a parameter copied from another parameter, from its own
values, or from temporaries computed at init) reads them from the storage it names, as it was at
that point of the sequence.

`replay` gives values only to the storages that matter: the targets (a stage's parameters) and,
going backwards through the record, every storage a needed op reads, at the point it reads it (a
source parameter of another stage is rebuilt into a scratch tensor, freed after its last read).
Every random draw runs in sequence, into scratch when not needed, so the CPU generator advances
exactly as in the eager build.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class Ref:
    """A tracked tensor an op of the build read or wrote: its storage's key, and its view."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    nbytes: int  # of the whole storage

    @classmethod
    def of(cls, tensor: torch.Tensor, key: int) -> Ref:
        return cls(key, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
                   tensor.dtype, tensor.untyped_storage().nbytes())

    def whole(self) -> bool:
        """Whether the view covers its whole storage, each element once."""
        if self.offset or math.prod(self.size) * self.dtype.itemsize != self.nbytes:
            return False
        expected = 1  # dense: the strides, smallest first, are the running sizes' products
        for size, stride in sorted((d for d in zip(self.size, self.stride) if d[0] != 1),
                                   key=lambda d: d[1]):
            if stride != expected:
                return False
            expected *= size
        return True

    def scratch(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype)


@dataclass(frozen=True)
class Like:
    """A meta tensor read only for its layout (``empty_like(p)``, ``rand_like(p)``)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Like:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    def scratch(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype)


@dataclass
class Op:
    """One recorded op: ``func(target, *args, **kwargs)`` in place when `target` is set, else
    ``func(*args, **kwargs)`` whose results (pytree leaves) fill the storages in `outputs`."""

    func: object
    target: Ref | None
    args: tuple
    kwargs: dict
    random: bool
    rng_state: torch.Tensor | None = None  # generator state to start from (first draw, reseeds)
    outputs: tuple[Ref | None, ...] = ()   # per result leaf: the new storage it fills, if any
    overwrites: bool = False  # in place, sets every value of its target's storage (``normal_``)
    # real tensors read, with their version then: one changed in place since is refused
    versions: tuple[tuple[torch.Tensor, int], ...] = field(default=(), repr=False)

    @property
    def target_key(self) -> int | None:
        return self.target.key if self.target is not None else None

    def reads(self) -> set[int]:
        return {x.key for x in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(x, Ref)}

    def writes(self) -> set[int]:
        keys = {r.key for r in self.outputs if r is not None}
        return keys | {self.target.key} if self.target is not None else keys


def _plan(ops: list[Op | None], targets: set[int]) -> tuple[list[set[int] | None], dict]:
    """Per op, the storages it writes that something needs (None: it need not run), and index
    -> the storages last used there. Backwards from the targets: a needed op's reads are needed
    before it, and a storage it overwrites whole is not (unless it reads it too)."""
    needed = set(targets)
    live: list[set[int] | None] = [None] * len(ops)
    last: dict[int, list[int]] = {}
    seen: set[int] = set()
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        hit = op.writes() & needed if op is not None else None
        if not hit:
            continue
        live[i] = hit
        reads = op.reads()
        needed -= {r.key for r in op.outputs if r is not None}
        if op.overwrites:
            needed.discard(op.target.key)
        needed |= reads
        for key in hit | reads:
            if key not in seen:
                seen.add(key)
                last.setdefault(i, []).append(key)
    return live, last


def replay(ops: list[Op | None], targets: dict[int, torch.Tensor],
           done: Callable[[int], None] = lambda key: None) -> None:
    """Replay `ops` into `targets` (storage key -> tensor of that storage's layout); `done(key)`
    runs right after the last op that writes or reads that key."""
    live, last = _plan(ops, set(targets))
    values: dict[int, torch.Tensor] = {}  # storage key -> its value, from its first write on
    pending = dict(targets)
    for i, op in enumerate(ops):
        if op is None:
            continue
        if op.rng_state is not None:
            torch.set_rng_state(op.rng_state)
        if live[i]:
            _run(op, values, live[i], pending)
        elif op.random:  # advances the generator as the eager build's draw did: into scratch
            _run(op, None, set(), pending)
        for key in last.get(i, ()):
            del values[key]
            if key in targets:
                done(key)


def _run(op: Op, values: dict[int, torch.Tensor] | None, needed: set[int],
         pending: dict[int, torch.Tensor]) -> None:
    """Run `op` on the real values of its storages, or on scratch tensors (`values` None);
    only the results in `needed` are kept."""
    for tensor, version in op.versions:
        if tensor._version != version:
            raise ValueError(f"a real tensor that {op.func} read while the model was built inside "
                             f"merak.init_empty_weights() was modified in place afterwards, so "
                             f"the value it read is lost; build that tensor anew for each use")

    def real(x):
        if isinstance(x, Ref):
            return x.scratch() if values is None else _view(values, pending, x, write=False)
        if isinstance(x, Like):
            return x.scratch()
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    args, kwargs = pytree.tree_map(real, (op.args, op.kwargs))
    with torch.no_grad():
        if op.target is not None:
            target = (op.target.scratch() if values is None
                      else _view(values, pending, op.target, write=True))
            op.func(target, *args, **kwargs)
            return
        result = op.func(*args, **kwargs)
        if values is not None:
            for ref, value in zip(op.outputs, pytree.tree_leaves(result)):
                if ref is not None and ref.key in needed:
                    _view(values, pending, ref, write=True).copy_(value)


def _view(values: dict[int, torch.Tensor], pending: dict[int, torch.Tensor], ref: Ref,
          write: bool) -> torch.Tensor:
    """`ref`'s view of its storage's value; a write may start that value (a target's own
    tensor, else a new one if it writes the whole storage)."""
    base = values.get(ref.key)
    if base is None:
        if write and ref.key in pending:
            base = values[ref.key] = pending.pop(ref.key)
        elif write and ref.whole():
            base = values[ref.key] = torch.empty(ref.nbytes // ref.dtype.itemsize,
                                                 dtype=ref.dtype)
        else:
            raise ValueError(
                f"the init of this model reads a meta tensor ({list(ref.size)}, {ref.dtype}) "
                f"no recorded op gave all its values before (made on the meta device outside "
                f"merak.init_empty_weights(), or only partly written); build this model "
                f"without init_empty_weights or load it from a checkpoint")
    if base.dtype != ref.dtype:  # a view of the storage as another dtype
        base = base.reshape(-1).view(ref.dtype)
    return base.as_strided(ref.size, ref.stride, ref.offset)
