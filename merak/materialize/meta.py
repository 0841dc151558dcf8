"""Build models without memory, then materialize one stage exactly as the full model would be.

`init_empty_weights()` puts every parameter created inside it on the meta device (buffers stay
real, so non-persistent buffers such as rotary ``inv_freq`` keep their values) and records, at
the ATen level, every op of the build on meta tensors: in-place writes (``normal_``, ``copy_``),
the out-of-place ops that make new meta tensors (``log(A)``, ``p / c``, ``zeros_like(p)``) and
every random draw (`merak.materialize.record`; `merak.materialize.replay` holds the record's
form). Draws on meta tensors do not advance the CPU generator, so its state is recorded at the
first draw and wherever it changed since the previous one (a ``torch.manual_seed`` inside the
context, e.g. in a model factory, or a real draw).

`materialize_(module)` gives each meta parameter of `module` real storage and replays the record
from those states: the ops this module's parameters depend on run on real values (an init that
reads another parameter, even one another stage holds, reads it rebuilt into a scratch tensor),
random draws nobody here needs are made into scratch and dropped. The generator therefore
advances exactly as in an eager build, so a stage gets the values the seeded single-process model
has, while holding only its own parameters (and the scratch tensors of the moment). The replay
runs on the CPU; `materialize_(module, device)` then leaves the whole stage on `device`:
parameters, buffers and the constants of the stage graphs an automatic split made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx, nn

from merak.materialize.build_patches import (
    _inits_on_meta,
    _mark_from_pretrained,
    _note_reseeds,
    _storage_key,
    _track_data_assignments,
    _values_through_dispatch,
)
from merak.materialize.record import InitRecord, _Recorder
from merak.materialize.replay import replay

RECORD_ATTR = "_merak_init_record"
# what other parts of merak note on a parameter (tensor-parallel shard and gradient flags)
_CARRIED_ATTRS = ("tp_shard", "tp_partial_grad", "ep_shard", "expert_parallel")


def storage_key(param: torch.Tensor) -> int:
    """The key under which the meta build recorded the writes to `param`."""
    record = getattr(param, RECORD_ATTR, None)
    return record.key(param) if record is not None else _storage_key(param)


@contextlib.contextmanager
def init_empty_weights(record: InitRecord | None = None) -> Iterator[InitRecord]:
    """Construct models without parameter memory (parameters on the meta device).

    Example:
        with merak.init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)

    `record` (default: a new one) continues the record of an earlier build, so what is built
    now is initialized as if built right after it in one eager run (peft adapters added to a
    meta model: `merak.lora`).
    """
    record = record if record is not None else InitRecord()
    if record.recording:
        raise RuntimeError("init_empty_weights(record) inside an init_empty_weights of the same "
                           "record would record every op twice")
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            real = param
            record.paused = True  # the move is replayed as `keep_initial_value` records it
            try:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            finally:
                record.paused = False
            record.keep_initial_value(param, real)
        if param is not None:
            setattr(param, RECORD_ATTR, record)
        original(module, name, param)

    undo = []
    try:
        nn.Module.register_parameter = register_parameter
        recorder = _Recorder(record)
        for patch in (lambda: _track_data_assignments(record), _mark_from_pretrained,
                      _values_through_dispatch, lambda: _inits_on_meta(recorder.record_call),
                      lambda: _note_reseeds(record)):
            undo.append(patch())  # each returns its undo
        record.recording = True
        with recorder:
            yield record
    finally:
        record.recording = False
        nn.Module.register_parameter = original
        for patch in reversed(undo):
            patch()


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def record_of(module: nn.Module) -> InitRecord | None:
    """The init record `module`'s meta parameters were built under (None if none was)."""
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
    real = _materialize_parameters(module, meta, reached, device, initialize) if meta else {}
    for sub in reached:
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) in real:
                sub._parameters[name] = real[id(param)]
    _move_rest_(module, reached, device, initialize)
    return list(meta)


def _materialize_parameters(module: nn.Module, meta: dict[str, nn.Parameter],
                            reached: list[nn.Module], device: torch.device,
                            initialize: bool) -> dict[int, nn.Parameter]:
    """id of each meta parameter -> its real replacement on `device`. With `initialize`, the
    buffers of `reached` whose build-time values are not the eager build's (drawn at random
    after meta draws: tainted) are replayed too, in place."""
    record = record_of(module)
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
    written = record.defined if initialize else set()

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
        if keys[id(p)] not in written:  # filled from a checkpoint later: only its own shape
            values[id(p)] = torch.empty(p.shape, dtype=p.dtype)
            continue
        values[id(p)] = torch.empty(specs[id(p)].full_shape if specs[id(p)] else p.shape,
                                    dtype=p.dtype)
    if initialize:
        by_key = {keys[id(p)]: p for p in unique}
        targets = {k: values[id(p)] for k, p in by_key.items() if k in written}
        for sub in reached:
            for buffer in sub._buffers.values():
                if buffer is not None and not buffer.is_meta and \
                        record.key(buffer) in record.tainted:
                    targets[record.key(buffer)] = buffer
        replay(record.ops, targets,
               done=lambda key: finish(by_key[key]) if key in by_key else None)
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
