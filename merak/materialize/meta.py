"""Build models without memory, then materialize one stage exactly as the full model would be.

`init_empty_weights()` puts every parameter created inside it on the meta device (buffers stay
real, so non-persistent buffers such as rotary ``inv_freq`` keep their values) and records, at
the ATen level, every in-place write to those parameters and every random draw made during
construction. Draws on meta tensors do not advance the CPU generator, so its state is recorded
at the first draw and wherever it changed since the previous one (a ``torch.manual_seed`` inside
the context, e.g. in a model factory, or a real draw).

`materialize_(module)` gives each meta parameter of `module` real storage and replays the record
from those states: writes to this module's parameters are applied to them, random draws for
anybody else's are made into a scratch tensor and dropped. The generator therefore advances
exactly as in an eager build, so a stage gets the values the seeded single-process model has,
while holding only its own parameters (and one scratch tensor at a time). The replay runs on the
CPU; `materialize_(module, device)` then leaves the whole stage on `device`: parameters, buffers
and the constants of the stage graphs an automatic split made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from merak.materialize.build_patches import (PRETRAINED_ATTR, _mark_from_pretrained,
                                             _storage_key, _track_data_assignments)

# in-place ops that overwrite every element of their target
_FULL_WRITES = frozenset({"uniform_", "normal_", "fill_", "zero_", "copy_", "random_",
                          "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_"})
_COPY_OPS = frozenset({"clone", "constant_pad_nd", "_to_copy"})  # value-preserving, new storage
_RANDOM_OPS = frozenset({
    "bernoulli", "bernoulli_", "cauchy_", "exponential_", "geometric_", "log_normal_", "multinomial",
    "normal", "normal_", "rand", "rand_like", "randint", "randint_like", "randn", "randn_like",
    "random_", "randperm", "uniform_",
})
RECORD_ATTR = "_merak_init_record"
# what other parts of merak note on a parameter (tensor-parallel shard and gradient flags)
_CARRIED_ATTRS = ("tp_shard", "tp_partial_grad")


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def storage_key(param: torch.Tensor) -> int:
    """The key under which the meta build recorded the writes to `param`."""
    record = getattr(param, RECORD_ATTR, None)
    return record.key(param) if record is not None else _storage_key(param)


@dataclass
class _Op:
    func: object
    target_key: int | None        # storage of the meta tensor written, None for other draws
    view: tuple | None            # (size, stride, storage_offset, dtype) of the written view
    args: tuple
    kwargs: dict
    random: bool
    rng_state: torch.Tensor | None = None  # generator state to start from (first draw, reseeds)
    produces: bool = False  # an out-of-place draw whose result is the target's value
    temporary: torch.Tensor | None = None  # the meta temporary written in place, if that


@dataclass
class InitRecord:
    """What constructing a model inside `init_empty_weights` did to its parameters."""

    ops: list[_Op | None] = field(default_factory=list)
    # the storages written: alive while the record is, so no later tensor takes the address that
    # identifies them (HF's `param.data = ...` can detach a recorded storage from its parameter)
    keepalive: list[torch.UntypedStorage] = field(default_factory=list, repr=False)
    # storage key -> index in `ops` of the copy of a value a parameter was created with
    initial_values: dict[int, int] = field(default_factory=dict, repr=False)
    # storage key of a meta tensor -> key of the storage it is a whole copy of (clone, zero pad)
    copies: dict[int, int] = field(default_factory=dict, repr=False)
    # storage a parameter was re-pointed to (`param.data = param.data.clone()`) -> its first one
    aliases: dict[int, int] = field(default_factory=dict, repr=False)
    written: set[int] = field(default_factory=set, repr=False)  # keys some op wrote
    # storage key of a real tensor drawn during the build -> index in `ops` of its draw
    real_draws: dict[int, int] = field(default_factory=dict, repr=False)
    # meta temporaries an init computes from (Mamba's ``log(arange(...))``, ``exp(rand(...))``):
    # id -> the out-of-place op that made it, or the index in `ops` of its random draw
    producers: dict[int, _Op] = field(default_factory=dict, repr=False)
    drawn: dict[int, int] = field(default_factory=dict, repr=False)
    temporaries: list = field(default_factory=list, repr=False)  # keeps those ids unique

    def note_value(self, func, args, kwargs, out) -> None:
        """Remember how a meta tensor outside the parameters was computed (out-of-place, from
        constants and other such tensors), should a parameter later be written from it."""
        if not isinstance(out, torch.Tensor) or not out.is_meta or func._schema.is_mutable:
            return
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if all(self.knows(a) for a in inputs if a.is_meta):
            self.producers[id(out)] = _Op(func, None, None, tuple(args), dict(kwargs), False)
            self.temporaries.append(out)

    def knows(self, tensor: torch.Tensor) -> bool:
        """Whether replay can give `tensor` a value: a recorded temporary. (An init reading a
        parameter's own values, ``copy_(p, p.log())``, is not replayed yet.)"""
        return id(tensor) in self.producers or id(tensor) in self.drawn

    def key(self, tensor: torch.Tensor) -> int:
        """The storage key under which the writes to `tensor`'s parameter are recorded."""
        key = _storage_key(tensor)
        return self.aliases.get(key, key)

    def keep_initial_value(self, meta: torch.Tensor, real: torch.Tensor) -> None:
        """A parameter created from a real tensor (``nn.Parameter(torch.zeros(n))``): its value
        is replayed as a copy unless a later op overwrites it whole. A tensor drawn at random
        (``nn.Parameter(torch.normal(0, s, size))``, DiffLlama's lambdas) was drawn here while
        the meta draws before it left the generator alone: its draw is replayed in its place
        in the sequence instead, so it gets the value the eager build gives it."""
        key = _storage_key(meta)
        draw = self.real_draws.get(_storage_key(real))
        whole = real.numel() * real.element_size() == real.untyped_storage().nbytes()
        if draw is not None and whole and real.storage_offset() == 0:
            op = self.ops[draw]
            op.target_key, op.produces = key, True
            op.view = (tuple(meta.shape), tuple(meta.stride()), 0, meta.dtype)
            self.keepalive.append(meta.untyped_storage())
            return
        self.initial_values[key] = len(self.ops)
        self.keepalive.append(meta.untyped_storage())
        self.ops.append(_Op(torch.ops.aten.copy_.default, key,
                            (tuple(meta.shape), tuple(meta.stride()), 0, meta.dtype),
                            (real.detach(),), {}, False))

    def drop_initial_value(self, key: int) -> None:
        index = self.initial_values.pop(key, None)
        if index is not None:
            self.ops[index] = None  # frees the real tensor


class _Recorder(TorchDispatchMode):
    def __init__(self, record: InitRecord):
        super().__init__()
        self.record = record
        self.last_state: torch.Tensor | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        state = None
        if name in _RANDOM_OPS:  # meta draws leave the generator alone: a changed state means
            state = torch.get_rng_state()  # a (re)seed or a real draw since the last one
            if self.last_state is not None and torch.equal(state, self.last_state):
                state = None
            else:
                self.last_state = state
        out = func(*args, **kwargs)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _COPY_OPS and target is not None and target.is_meta and _is_copy(target, out, args):
            self.record.copies[_storage_key(out)] = self.record.key(target)
            self.record.keepalive.append(out.untyped_storage())
        writes_meta = (func._schema.is_mutable and target is not None
                       and target.device.type == "meta")
        random = name in _RANDOM_OPS
        if not (writes_meta or random):
            self.record.note_value(func, args, kwargs, out)
        if writes_meta or random:
            if any(isinstance(a, torch.Tensor) and a.device.type == "meta"
                   and not self.record.knows(a) for a in args[1:]):
                # e.g. copying one meta parameter into another: its value is unknown here
                raise NotImplementedError(
                    f"init_empty_weights cannot replay {func} reading another meta tensor; build "
                    f"this model without init_empty_weights or load it from a checkpoint")
            key = view = None
            if writes_meta:
                key = self.record.key(target)
                self.record.written.add(key)
                view = (tuple(target.shape), tuple(target.stride()), target.storage_offset(),
                        target.dtype)
                self.record.keepalive.append(target.untyped_storage())
                if name in _FULL_WRITES and target.numel() == target.untyped_storage().nbytes() \
                        // target.element_size():
                    self.record.drop_initial_value(key)  # overwritten whole: not needed
            self.record.ops.append(_Op(func, key, view, tuple(args[1:]) if writes_meta else
                                       tuple(args), dict(kwargs), random, state))
            if writes_meta and (id(target) in self.record.producers
                                or id(target) in self.record.drawn) \
                    and _storage_key(target) not in self.record.copies:  # ``A.uniform_(0, 16)``
                # (a copy of a parameter is its would-be storage: see `_track_data_assignments`)
                self.record.ops[-1].temporary = target
            if random and not writes_meta and isinstance(out, torch.Tensor) and out.is_meta:
                self.record.drawn[id(out)] = len(self.record.ops) - 1  # a temporary drawn here
                self.record.temporaries.append(out)
            if random and isinstance(out, torch.Tensor) and not out.is_meta:
                # a real draw: the next meta draw must not take its advance for a reseed
                self.last_state = torch.get_rng_state()
                self.record.real_draws[_storage_key(out)] = len(self.record.ops) - 1
        return out


def _is_copy(source: torch.Tensor, out, args: tuple) -> bool:
    """Whether `out` holds exactly the values of `source`'s whole storage."""
    pads = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    if any(pads):  # constant_pad_nd that really pads
        return False
    whole = source.numel() * source.element_size() == source.untyped_storage().nbytes()
    return (isinstance(out, torch.Tensor) and out.is_meta and whole and out.shape == source.shape
            and out.dtype == source.dtype)


@contextlib.contextmanager
def init_empty_weights() -> Iterator[InitRecord]:
    """Construct models without parameter memory (parameters on the meta device).

    Example:
        with merak.init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    """
    record = InitRecord()
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            real = param
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            record.keep_initial_value(param, real)
        if param is not None:
            setattr(param, RECORD_ATTR, record)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    undo_data = _track_data_assignments(record)
    undo_pretrained = _mark_from_pretrained()
    try:
        with _Recorder(record):
            yield record
    finally:
        nn.Module.register_parameter = original
        undo_data()
        undo_pretrained()


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _record_of(module: nn.Module) -> InitRecord | None:
    for param in module.parameters():
        record = getattr(param, RECORD_ATTR, None)
        if record is not None:
            return record
    return None


def materialize_(module: nn.Module, device: torch.device | str = "cpu", *,
                 initialize: bool = True) -> list[str]:
    """Give every meta parameter of `module` real storage on `device`, and move the rest of
    `module` there, in place.

    Each meta parameter is replaced, everywhere under `module`, by one real parameter (so
    parameters tied inside `module` stay tied). With `initialize`, values are those the eager
    build would have given (see the module docstring); without it they are uninitialized, to be
    filled from a checkpoint. Returns the materialized parameter names.

    The whole stage ends on `device`: its other parameters, its buffers (non-persistent ones such
    as rotary ``inv_freq``, snapshotted real at build, included) and the tensor constants of the
    fx graphs it runs (what their ``get_attr`` nodes read), also in the modules it holds without
    registering them (`_held_modules`: a pipeline stage's flat graph pieces, an interleaved
    stage's chunks). A buffer or constant left on the meta device has no recorded value: with
    `initialize` that is an error, without it it gets uninitialized storage like a parameter.
    """
    device = torch.device(device)
    reached = _held_modules(module)
    meta = {name: p for name, p in module.named_parameters(remove_duplicate=False) if p.is_meta}
    real = _materialize_parameters(module, meta, device, initialize) if meta else {}
    for sub in reached:
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) in real:
                sub._parameters[name] = real[id(param)]
    _move_rest_(module, reached, device, initialize)
    return list(meta)


def _materialize_parameters(module: nn.Module, meta: dict[str, nn.Parameter],
                            device: torch.device, initialize: bool) -> dict[int, nn.Parameter]:
    """id of each meta parameter -> its real replacement on `device`."""
    record = _record_of(module)
    if initialize and record is None:
        raise ValueError("these meta parameters were not built inside merak.init_empty_weights(), "
                         "so their initial values are unknown; load them from a checkpoint")
    # Initialize on the CPU, whose generator the eager build draws from, then move. A tensor-
    # parallel shard (`param.tp_shard`) is initialized whole, and cut to this rank's slice as
    # soon as its last init op has run, so only the tensors being initialized are ever whole.
    unique = list({id(p): p for p in meta.values()}.values())
    specs = {id(p): getattr(p, "tp_shard", None) for p in unique}
    keys = {id(p): specs[id(p)].source_key if specs[id(p)] else storage_key(p) for p in unique}
    values: dict[int, torch.Tensor] = {}
    written = {op.target_key for op in record.ops if op is not None} if initialize else set()

    def finish(p) -> None:
        if specs[id(p)] is not None:
            values[id(p)] = specs[id(p)].take(values[id(p)]).contiguous()

    if initialize:
        names = {id(p): n for n, p in reversed(meta.items())}
        unknown = [names[id(p)] for p in unique if keys[id(p)] not in written]
        if unknown:
            raise ValueError(f"no value was recorded for {unknown}: they were created on the meta "
                             f"device or re-pointed (`param.data = ...`) after their init inside "
                             f"merak.init_empty_weights(); load them from a checkpoint instead")
    for p in unique:
        values[id(p)] = torch.empty(specs[id(p)].full_shape if specs[id(p)] else p.shape,
                                    dtype=p.dtype)
        if keys[id(p)] not in written:
            finish(p)  # filled from a checkpoint later
    if initialize:
        by_key = {keys[id(p)]: p for p in unique}
        _replay(record, {k: values[id(p)] for k, p in by_key.items()},
                done=lambda key: finish(by_key[key]))
    real = {}
    for p in unique:
        real[id(p)] = nn.Parameter(values.pop(id(p)).to(device), requires_grad=p.requires_grad)
        for attr in _CARRIED_ATTRS:
            if hasattr(p, attr):
                setattr(real[id(p)], attr, getattr(p, attr))
    return real


def _held_modules(module: nn.Module) -> list[nn.Module]:
    """`module`'s submodules, and the modules any of them holds in a plain list, tuple or dict
    attribute without registering it (with theirs): a `PipelineStage` keeps its flat graph
    pieces (whose roots hold graph constants) in ``_flat``, an `InterleavedStage` its chunks
    (whose parameter-free helpers only the first chunk registers) in ``chunks``."""
    seen: set[int] = set()
    found: list[nn.Module] = []
    todo = [module]
    while todo:
        for sub in todo.pop().modules():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            found.append(sub)
            for name, value in vars(sub).items():
                if name in ("_modules", "_parameters", "_buffers"):
                    continue
                items = value.values() if isinstance(value, dict) else \
                    value if isinstance(value, (list, tuple)) else ()
                todo.extend(v for v in items if isinstance(v, nn.Module) and id(v) not in seen)
    return found


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None
                                                  or tensor.device.index == device.index)


def _move_rest_(module: nn.Module, reached: list[nn.Module], device: torch.device,
                initialize: bool) -> None:
    """Real parameters, buffers and graph constants of `reached` onto `device`; one tensor held
    in several places stays one tensor."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    # id of a tensor -> (it, its replacement): holding the original keeps its id unique
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    unknown: list[str] = []

    def place(tensor: torch.Tensor, where: str) -> torch.Tensor:
        if id(tensor) not in moved:
            if tensor.is_meta and device.type != "meta":
                if initialize:
                    unknown.append(where)
                    return tensor
                new = torch.empty_like(tensor, device=device)
            else:
                new = tensor if _on(tensor, device) else tensor.to(device)
            moved[id(tensor)] = (tensor, new)
        return moved[id(tensor)][1]

    for sub in reached:
        prefix = names.get(id(sub), type(sub).__name__)
        prefix = f"{prefix}." if prefix else ""
        for param in sub._parameters.values():
            if param is not None and not param.is_meta and not _on(param, device) \
                    and id(param) not in moved:
                param.data = param.data.to(device)  # the same Parameter: optimizers keep it
                moved[id(param)] = (param, param)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = place(buffer, prefix + name)
        if isinstance(sub, fx.GraphModule):  # constants read by get_attr, held as attributes
            for node in sub.graph.nodes:
                if node.op != "get_attr":
                    continue
                *path, attr = node.target.split(".")
                owner = sub
                for part in path:
                    owner = getattr(owner, part, None)
                value = getattr(owner, attr, None) if owner is not None else None
                if (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
                        and not (isinstance(owner, nn.Module) and attr in owner._buffers)):
                    setattr(owner, attr, place(value, prefix + node.target))
    if unknown:
        raise ValueError(f"{unknown} are on the meta device but are not parameters, so no "
                         f"value was recorded for them (build buffers and constants real inside "
                         f"merak.init_empty_weights()); materialize with initialize=False and "
                         f"load them from a checkpoint")


def _replay(record: InitRecord, targets: dict[int, torch.Tensor],
            done: Callable[[int], None] = lambda key: None) -> None:
    """Replay the record into `targets` (storage key -> tensor); `done(key)` runs right after
    the last op writing that key."""
    last = {op.target_key: i for i, op in enumerate(record.ops)
            if op is not None and op.target_key in targets}
    drawn_at = {i: key for key, i in record.drawn.items()}
    values: dict[int, torch.Tensor] = {}  # id of a meta temporary -> its real value

    def real(x):
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        if not (isinstance(x, torch.Tensor) and x.is_meta):
            return x
        if id(x) not in values:  # an out-of-place op of the build (draws are in sequence)
            made = record.producers[id(x)]
            values[id(x)] = made.func(*pytree.tree_map(real, made.args),
                                      **pytree.tree_map(real, made.kwargs))
        return values[id(x)]

    for i, op in enumerate(record.ops):
        if op is None:
            continue
        if op.rng_state is not None:
            torch.set_rng_state(op.rng_state)
        param = targets.get(op.target_key) if op.target_key is not None else None
        if op.temporary is not None:
            with torch.no_grad():
                op.func(real(op.temporary), *pytree.tree_map(real, op.args),
                        **pytree.tree_map(real, op.kwargs))
        elif param is not None:
            size, stride, offset, _ = op.view
            args = pytree.tree_map(real, op.args)
            with torch.no_grad():
                if op.produces:
                    kwargs = {**op.kwargs, **({"device": "cpu"} if "device" in op.kwargs else {})}
                    param.as_strided(size, stride, offset).copy_(op.func(*args, **kwargs))
                else:
                    op.func(param.as_strided(size, stride, offset), *args, **op.kwargs)
            if last[op.target_key] == i:
                del targets[op.target_key]
                done(op.target_key)
        elif op.random:
            if op.view is not None and not op.produces:  # a draw into somebody else's
                # parameter: same numel, dropped
                size, stride, _, dtype = op.view
                op.func(torch.empty_strided(size, stride, dtype=dtype), *op.args, **op.kwargs)
            else:
                kwargs = dict(op.kwargs)
                if "device" in kwargs:
                    kwargs["device"] = "cpu"
                drawn = op.func(*op.args, **kwargs)
                if i in drawn_at:  # a temporary an init computes from: kept for `real`
                    values[drawn_at[i]] = drawn
