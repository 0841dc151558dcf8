"""The record `init_empty_weights` keeps of a model's build (see `merak.materialize.meta`).

A `TorchDispatchMode` sees every ATen op of the build. It records, as `replay.Op`s naming
tracked tensors by `replay.Ref`: in-place writes to meta tensors, out-of-place ops that make new
meta storage (views make none: their `Ref`s address their base), and every draw from the default
generator with its state wherever that changed since the previous draw (meta draws leave it
alone, so a change means a (re)seed or a real draw since). A real draw's values here are not the
eager build's: its storage is tainted, and tracked like a meta one, as is everything computed
from it. The `torch.nn.init` functions that skip meta tensors are recorded as one op each
(`record_call`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from merak.materialize.build_patches import _storage_key
from merak.materialize.replay import Like, Op, Ref

# in-place ops that overwrite every element of their target
_FULL_WRITES = frozenset({"uniform_", "normal_", "fill_", "zero_", "copy_", "random_",
                          "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_"})
_COPY_OPS = frozenset({"clone", "constant_pad_nd", "_to_copy"})  # value-preserving, new storage
_RANDOM_OPS = frozenset({
    "bernoulli", "bernoulli_", "cauchy_", "exponential_", "geometric_", "log_normal_",
    "multinomial", "normal", "normal_", "rand", "rand_like", "randint", "randint_like", "randn",
    "randn_like", "random_", "randperm", "uniform_",
})
# ops that read only the layout of their first argument, and those whose result has no values
_SHAPE_ONLY = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
                         "randn_like", "randint_like", "new_empty", "new_empty_strided",
                         "new_zeros", "new_ones", "new_full"})
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                            "new_empty_strided"})
# in-place ops that change a tensor's view of its storage, not its values
_METADATA_INPLACE = frozenset({"as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_",
                               "swapdims_", "swapaxes_", "detach_"})


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _mutated(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors `func` writes in place (its schema's mutable arguments)."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            found.extend(t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
    return found


def _key_or_none(tensor: torch.Tensor) -> int | None:
    """`tensor`'s storage key; None for a tensor without storage (sparse, nested)."""
    try:
        return _storage_key(tensor)
    except (RuntimeError, NotImplementedError):
        return None


def _versions(tree) -> tuple[tuple[torch.Tensor, int], ...]:
    """The real tensors in `tree` with their version counters now."""
    found = []
    for x in pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor) and not x.is_meta and not x.is_inference():
            found.append((x, x._version))
    return tuple(found)


@dataclass
class InitRecord:
    """What constructing a model inside `init_empty_weights` did to its parameters."""

    ops: list[Op | None] = field(default_factory=list)
    # every storage an op names, by key: alive while the record is, so no later tensor takes the
    # address that identifies it (HF's `param.data = ...` can detach a recorded storage from its
    # parameter, and temporaries are dropped right after use; the real ones are only tainted
    # ones, which the old code held in the ops as well)
    keepalive: dict[int, torch.UntypedStorage] = field(default_factory=dict, repr=False)
    # storage key -> index in `ops` of the copy of a value a parameter was created with
    initial_values: dict[int, int] = field(default_factory=dict, repr=False)
    # storage key of a meta tensor -> key of the storage it is a whole copy of (clone, zero pad)
    copies: dict[int, int] = field(default_factory=dict, repr=False)
    # storage a parameter was re-pointed to (`param.data = param.data.clone()`) -> its first one
    aliases: dict[int, int] = field(default_factory=dict, repr=False)
    written: set[int] = field(default_factory=set, repr=False)  # keys some op wrote in place
    # keys an op gave values (written, or made with values: not ``empty``): a parameter's must be
    defined: set[int] = field(default_factory=set, repr=False)
    read: set[int] = field(default_factory=set, repr=False)  # keys some op read
    # real storages whose values here are not the eager build's: drawn at random (the meta
    # draws before left the generator behind) or computed from such: replayed like meta ones
    tainted: set[int] = field(default_factory=set, repr=False)
    paused: bool = field(default=False, repr=False)  # ops not recorded (a parameter's move)
    recording: bool = field(default=False, repr=False)  # inside an init_empty_weights of it
    # the generator's state at the last draw recorded or real draw seen (a later context that
    # continues this record, `init_empty_weights(record)`, goes on from it)
    last_state: torch.Tensor | None = field(default=None, repr=False)

    def key(self, tensor: torch.Tensor) -> int:
        """The storage key under which the writes to `tensor`'s parameter are recorded."""
        key = _storage_key(tensor)
        return self.aliases.get(key, key)

    def tracked(self, x) -> bool:
        """Whether `x` is a tensor whose values the replay computes (meta, or tainted)."""
        return isinstance(x, torch.Tensor) and (x.is_meta or bool(self.tainted)
                                                and _key_or_none(x) in self.tainted)

    def ref(self, tensor: torch.Tensor) -> Ref:
        self.keepalive.setdefault(_storage_key(tensor), tensor.untyped_storage())
        if not tensor.is_meta:
            self.tainted.add(_storage_key(tensor))
        return Ref.of(tensor, self.key(tensor))

    def reads(self, tree):
        """`tree` with each tracked tensor replaced by its `Ref` (noted as read)."""
        def ref(x):
            if not self.tracked(x):
                return x
            ref = self.ref(x)
            self.read.add(ref.key)
            return ref
        return pytree.tree_map(ref, tree)

    def keep_initial_value(self, meta: torch.Tensor, real: torch.Tensor) -> None:
        """A parameter created from a real tensor (``nn.Parameter(torch.zeros(n))``): its value
        is replayed as a copy unless a later op overwrites it whole. A tensor drawn at random
        (``nn.Parameter(torch.normal(0, s, size))``, DiffLlama's lambdas) was drawn while the
        meta draws before it left the generator alone: the copy reads its replayed draw."""
        ref = self.ref(meta)
        self.defined.add(ref.key)
        self.initial_values[ref.key] = len(self.ops)
        (source,), _ = self.reads(((real.detach(),), {}))
        self.ops.append(Op(torch.ops.aten.copy_.default, ref, (source,), {}, False,
                           overwrites=ref.whole(), versions=_versions(source)))

    def drop_initial_value(self, key: int) -> None:
        """The initial value of a parameter overwritten whole, unless an op read it since."""
        index = self.initial_values.pop(key, None)
        if index is not None and key not in self.read:
            self.ops[index] = None  # frees the real tensor


class _Recorder(TorchDispatchMode):
    def __init__(self, record: InitRecord):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        record = self.record
        if record.paused:
            return func(*args, **kwargs)
        name = _op_name(func)
        # a draw from a generator of its own leaves the default one alone: a real one is kept
        # as is, a meta one cannot be replayed
        random = name in _RANDOM_OPS and kwargs.get("generator") is None
        mutated = _mutated(func, args, kwargs)
        reads = any(record.tracked(x) for x in pytree.tree_leaves((args, kwargs)))
        writes = bool(mutated) and name not in _METADATA_INPLACE and (reads or random)
        before = self._before(name, args[0]) if writes else None
        state = self._state() if random else None
        out = func(*args, **kwargs)
        if name in _RANDOM_OPS and not random and any(
                isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves((args, out))):
            _refuse_generator(func)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _COPY_OPS and first is not None and first.is_meta and _is_copy(first, out, args):
            record.copies[_storage_key(out)] = record.key(first)
        if writes:
            self._write(func, name, mutated, args, kwargs, random, state, before)
        elif not mutated and (reads or random or any(isinstance(o, torch.Tensor) and o.is_meta
                                                     for o in pytree.tree_leaves(out))):
            self._make(func, name, out, args, kwargs, random, state, reads)
        if random and not (first is not None and first.is_meta if mutated else
                           isinstance(out, torch.Tensor) and out.is_meta):
            # a real draw: the next meta draw must not take its advance for a reseed
            self.record.last_state = torch.get_rng_state()
        return out

    def _state(self) -> torch.Tensor | None:
        """For a draw: the generator's state, if it changed since the last draw. Meta draws
        leave it alone, so a change means a (re)seed or a real draw since."""
        state = torch.get_rng_state()
        if self.record.last_state is not None and torch.equal(state, self.record.last_state):
            return None
        self.record.last_state = state
        return state

    def record_call(self, function, tensor: torch.Tensor, args: tuple, kwargs: dict):
        """A `torch.nn.init` function that skips meta tensors (`_inits_on_meta`), called:
        recorded as one in-place op that runs `function` itself at replay. (On a real tensor its
        draws here start where the meta draws before left the generator: tainted too.)"""
        random = function.__name__ != "dirac_"
        if not (tensor.is_meta or random or self.record.tracked(tensor)):
            return function(tensor, *args, **kwargs)
        if any(isinstance(a, torch.Generator) for a in (*args, *kwargs.values())):
            _refuse_generator(function)
        before = self._before(function.__name__, tensor, whole=True)
        state = self._state() if random else None
        self.record.paused = True
        try:
            out = function(tensor, *args, **kwargs)  # its checks (on meta, it draws nothing)
        finally:
            self.record.paused = False
        if random and not tensor.is_meta:
            self.record.last_state = torch.get_rng_state()
        self._write(function, function.__name__, [tensor], (tensor, *args), kwargs, random,
                    state, before, whole=True)
        return out

    def _before(self, name: str, target, whole: bool = False) -> tuple | None:
        """For an op about to write part of a real tensor whose values were not replayed so
        far: that tensor's whole storage, and a copy of what it holds now (the replay starts
        from it)."""
        if not isinstance(target, torch.Tensor) or self.record.tracked(target) or (
                (whole or name in _FULL_WRITES) and Ref.of(target, 0).whole()):
            return None
        storage = target.untyped_storage()
        everything = target.as_strided((storage.nbytes() // target.element_size(),), (1,), 0)
        return everything, everything.clone()

    def _write(self, func, name, mutated, args, kwargs, random, state, before,
               whole=False) -> None:
        """An in-place op on a meta or tainted tensor, or one that taints a real tensor."""
        record = self.record
        target = args[0] if args else None
        if len(mutated) != 1 or mutated[0] is not target:
            raise NotImplementedError(
                f"init_empty_weights cannot replay {func}: it writes a tensor that is not its "
                f"first argument; build this model without init_empty_weights")
        op_args, op_kwargs = record.reads((args[1:], kwargs))
        whole = (whole or name in _FULL_WRITES) and Ref.of(target, 0).whole()
        if before is not None:  # a real tensor's values, replayed from here on
            record.ops.append(Op(torch.ops.aten.copy_.default, record.ref(before[0]),
                                 (before[1],), {}, False, overwrites=True))
        ref = record.ref(target)
        record.written.add(ref.key)
        record.defined.add(ref.key)
        if whole:
            record.drop_initial_value(ref.key)  # overwritten whole: not needed
        record.ops.append(Op(func, ref, op_args, op_kwargs, random, state, overwrites=whole,
                             versions=_versions((op_args, op_kwargs))))

    def _make(self, func, name, out, args, kwargs, random, state, reads) -> None:
        """An out-of-place op: recorded when it draws, reads tracked tensors or makes meta ones.
        Its results with new storage (not views) are tracked: real ones are tainted."""
        record = self.record
        inputs = {_key_or_none(t) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        outputs = tuple(record.ref(o) if isinstance(o, torch.Tensor) and _key_or_none(o)
                        not in inputs and (o.is_meta or reads or random) else None
                        for o in pytree.tree_leaves(out))
        if not random and not any(outputs):
            return
        if name in _SHAPE_ONLY and args and isinstance(args[0], torch.Tensor):
            args = (Like.of(args[0]), *args[1:])
        op_args, op_kwargs = record.reads((args, kwargs))
        if name not in _UNINITIALIZED:
            record.defined.update(ref.key for ref in outputs if ref is not None)
        record.ops.append(Op(func, None, op_args, op_kwargs, random, state, outputs,
                             versions=_versions((op_args, op_kwargs))))


def _refuse_generator(func) -> None:
    raise NotImplementedError(
        f"init_empty_weights cannot replay {func} drawing from a torch.Generator of its own on "
        f"the meta device (only the default generator's states are recorded); build this model "
        f"without init_empty_weights")


def _is_copy(source: torch.Tensor, out, args: tuple) -> bool:
    """Whether `out` holds exactly the values of `source`'s whole storage."""
    pads = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    if any(pads):  # constant_pad_nd that really pads
        return False
    whole = source.numel() * source.element_size() == source.untyped_storage().nbytes()
    return (isinstance(out, torch.Tensor) and out.is_meta and whole and out.shape == source.shape
            and out.dtype == source.dtype)
