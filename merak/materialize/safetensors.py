"""Load only this rank's tensors from an HF safetensors checkpoint, straight into their storage.

Reads the safetensors header (8-byte length + JSON) and `readinto`s each wanted tensor's bytes
into the parameter's own memory: no second copy of the tensor is ever allocated when dtypes
match, which keeps a rank's peak memory at its own share of the model (safetensors'
`get_tensor` allocates a fresh tensor per read). A tensor on a GPU (or needing a dtype change or
a tensor-parallel slice) is read into host memory once and copied over.

A checkpoint that transformers converts on load (a Mixtral's per-expert tensors, stacked into
fused experts in memory) is read through its `CheckpointLayout`: a parameter stored under
another layout is derived, with transformers' own conversion for the model class, from just
the checkpoint tensors it is made of (so a stage reads only its own layers' experts).

A tensor holding a range of rows of the checkpoint tensor (an expert-parallel slice: its
``ep_shard`` has ``rows``, the ``[first, end)`` of dimension 0 it holds, and ``take_rows``, the
rest of its cut applied to those rows) reads only those rows' bytes; one derived by stacking
per-expert checkpoint tensors (transformers' ``MergeModulelist``) reads only its own experts'
tensors. A rank then reads and allocates 1/ep of each experts tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from merak.materialize.build_patches import PRETRAINED_ATTR
from merak.materialize.conversion import CheckpointLayout, Derivation

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, {name: {"dtype", "shape", "data_offsets"}})."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def checkpoint_index(path: str | Path) -> dict[str, Path]:
    """Tensor name -> file, for a ``.safetensors`` file or an HF directory (single or sharded)."""
    path = Path(path)
    if path.is_file():
        return {name: path for name in read_header(path)[1]}
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    if (path / SINGLE_FILE).exists():
        return checkpoint_index(path / SINGLE_FILE)
    raise FileNotFoundError(f"no safetensors checkpoint at {path}: expected a .safetensors file, "
                            f"or a directory with {SINGLE_FILE} or {INDEX_FILE}")


def load_safetensors_(module: nn.Module, path: str | Path,
                      aliases: Mapping[str, Iterable[str]] | None = None,
                      names: Iterable[str] | None = None,
                      layout: CheckpointLayout | None = None) -> list[str]:
    """Fill `module`'s parameters and persistent buffers (or only `names`) from `path`, in place.

    Args:
        module: a module whose tensor names are the checkpoint's names (a pipeline stage is).
        path: a ``.safetensors`` file or an HF checkpoint directory.
        aliases: other names a tensor may be stored under (tied weights: HF stores one of
            ``lm_head.weight`` / ``embed_tokens.weight``).
        names: the tensor names to load; default every parameter, and every buffer the
            checkpoint has (others, like rotary ``inv_freq``, keep the values they were built
            with).
        layout: the conversions transformers applies when it loads this model
            (`CheckpointLayout`, e.g. a Mixtral's per-expert tensors stacked into its fused
            experts): a tensor missing by name is derived from the checkpoint tensors it is
            made of, reading only those.

    Raises:
        KeyError: a wanted tensor is in the checkpoint under none of its names, and no
            conversion makes it (the message names the conversion tried).
        ValueError: a stored (or derived) shape differs from the module's.
    """
    index = checkpoint_index(path)
    table = layout.derivations(index) if layout is not None else None
    known = table if table is not None else index
    params = dict(module.named_parameters(remove_duplicate=False))
    tensors = {**module.state_dict(keep_vars=True), **params}
    aliases = aliases or {}
    if names is None:  # buffers absent from the checkpoint were non-persistent in the model
        names = [n for n in tensors if n in params
                 or any(a in known for a in [n, *aliases.get(n, ())])]
    wanted = list(dict.fromkeys(names))
    plan: dict[Path, list[tuple[str, str]]] = {}
    derived: dict[int, tuple[Derivation, list[tuple[str, str]]]] = {}
    missing = []
    for name in wanted:
        stored = next((n for n in [name, *aliases.get(name, ())] if n in known), None)
        how = table[stored] if table is not None and stored is not None else None
        if stored is None:
            missing.append(name)
        elif how is not None and how.converter is not None:
            derived.setdefault(id(how), (how, []))[1].append((name, stored))
        else:
            source = how.sources[0][0] if how is not None else stored
            plan.setdefault(index[source], []).append((name, source))
    if missing:
        raise KeyError(_missing_message(missing, path, aliases, layout))
    for file, entries in plan.items():
        data_start, header = read_header(file)
        with open(file, "rb") as f:
            for name, stored in entries:
                _read_into(f, data_start, header[stored], tensors[name], name, file)
    headers: dict[Path, tuple[int, dict]] = {}
    for how, entries in derived.values():
        rows = _shared_rows([tensors[name] for name, _ in entries])
        experts = shard_of(tensors[entries[0][0]]).full_shape[0] if rows is not None else 0
        own = _own_sources(how, rows, experts) if rows is not None else None
        made = layout.derive(own or how, lambda key: _read_whole(index[key], key, headers))
        for name, target in entries:
            _copy_into(tensors[name], made[target], name, f"{how.describe()} in {path}",
                       rows=rows if own is not None else None)
    return wanted


def shard_of(tensor: torch.Tensor):
    """The cut of the whole (checkpoint) tensor that `tensor` holds: its expert-parallel slice
    (``ep_shard``, which includes any TP cut of its experts), else its tensor-parallel shard
    (``tp_shard``), else None."""
    return getattr(tensor, "ep_shard", None) or getattr(tensor, "tp_shard", None)


def _rows_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    spec = shard_of(tensor)
    return tuple(spec.rows) if spec is not None and hasattr(spec, "rows") else None


def _shared_rows(tensors: list[torch.Tensor]) -> tuple[int, int] | None:
    """The dim-0 row range every one of `tensors` holds, when they hold one and the same."""
    ranges = {_rows_of(t) for t in tensors}
    return next(iter(ranges)) if len(ranges) == 1 and None not in ranges else None


def _own_sources(how: Derivation, rows: tuple[int, int], experts: int) -> Derivation | None:
    """`how` reading only the checkpoint tensors of experts ``rows`` (of `experts`): when it
    stacks along dim 0 one checkpoint tensor per expert for each of its source patterns
    (transformers' ``MergeModulelist``, e.g. a Mixtral's ``experts.<i>.w1``), in expert order,
    each pattern's sources ``[first, end)``; None when it is not such a stack (then everything
    is read)."""
    if how.converter is None or not any(type(op).__name__ == "MergeModulelist"
                                        and getattr(op, "dim", 0) == 0
                                        for op in how.converter.operations):
        return None
    by_pattern: dict[str | None, list[tuple[str, str | None]]] = {}
    for source in how.sources:
        by_pattern.setdefault(source[1], []).append(source)
    counts = {len(group) for group in by_pattern.values()}
    first, end = rows
    if counts != {experts}:
        return None
    kept = {id(s) for group in by_pattern.values() for s in group[first:end]}
    return replace(how, sources=[s for s in how.sources if id(s) in kept])


def _missing_message(missing: list[str], path, aliases, layout: CheckpointLayout | None) -> str:
    shown = []
    for name in missing[:8]:
        tried = ""
        if layout is not None and layout.converts:
            tried = next((t for t in map(layout.tried, [*aliases.get(name, ()), name])
                          if not t.startswith("a tensor")), "a tensor stored under this name")
            tried = f" (tried: {tried})"
        shown.append(f"{name}{tried}")
    return (f"{len(missing)} tensors are not in the checkpoint {path}: {shown}"
            f"{' ...' if len(missing) > 8 else ''}")


def _read_whole(file: Path, key: str, headers: dict) -> torch.Tensor:
    """Checkpoint tensor `key` of `file`, as a new CPU tensor (headers cached in `headers`)."""
    if file not in headers:
        headers[file] = read_header(file)
    data_start, header = headers[file]
    info = header[key]
    begin, end = info["data_offsets"]
    raw = bytearray(end - begin)
    with open(file, "rb") as f:
        f.seek(data_start + begin)
        if f.readinto(raw) != end - begin:
            raise ValueError(f"{key}: the checkpoint {file} is truncated")
    dtype = _DTYPES[info["dtype"]]
    stored = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return stored.view(tuple(info["shape"]))


def _copy_into(tensor: torch.Tensor, full: torch.Tensor, name: str, where: str,
               rows: tuple[int, int] | None = None) -> None:
    """Copy `full` (the whole tensor; with `rows`, only those rows of dim 0 of it) into
    `tensor`, or into a shard this rank's cut of it; the dtype becomes the model's."""
    spec = shard_of(tensor)
    want = tuple(spec.full_shape if spec else tensor.shape)
    if rows is not None:
        want = (rows[1] - rows[0], *want[1:])
    if tuple(full.shape) != want:
        raise ValueError(f"{name}: {where} gives shape {list(full.shape)}, the model has "
                         f"{list(want)}")
    with torch.no_grad():
        tensor.data.copy_(spec.take_rows(full) if rows is not None else
                          spec.take(full) if spec else full)


def _read_into(f, data_start: int, info: dict, tensor: torch.Tensor, name: str,
               file: Path) -> None:
    shape = tuple(info["shape"])
    spec = shard_of(tensor)  # a TP shard: read whole, keep a slice; an ep slice: its rows
    if shape != tuple(spec.full_shape if spec else tensor.shape):
        raise ValueError(f"{name}: the checkpoint {file} stores shape {list(shape)}, the model "
                         f"has {list(spec.full_shape if spec else tensor.shape)}")
    dtype = _DTYPES[info["dtype"]]
    begin, end = info["data_offsets"]
    rows = _rows_of(tensor)
    if rows is not None:  # an expert-parallel slice: read only its experts' rows
        per_row = (end - begin) // shape[0] if shape[0] else 0
        begin, end = begin + rows[0] * per_row, begin + rows[1] * per_row
        shape = (rows[1] - rows[0], *shape[1:])
    cut = (spec.take_rows if rows is not None else spec.take) if spec is not None else None
    f.seek(data_start + begin)
    with torch.no_grad():
        target = tensor.data
        direct = cut is None or rows is not None and tuple(target.shape) == shape
        if direct and dtype == target.dtype and target.is_contiguous() \
                and target.device.type == "cpu":
            view = target.view(-1).view(torch.uint8).numpy()
            if f.readinto(view) != end - begin:
                raise ValueError(f"{name}: the checkpoint {file} is truncated")
            return
        raw = bytearray(end - begin)
        f.readinto(raw)
        stored = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        stored = stored.view(shape)
        target.copy_(cut(stored) if cut is not None else stored)


def pretrained_checkpoint(model: nn.Module) -> str | None:
    """The safetensors directory a meta model came from (``from_pretrained(path)`` inside
    `init_empty_weights` leaves its parameters on meta and records the path): each rank then
    loads its own shard from it. None for a model to initialize (``from_config``, whatever
    directory its config and so its ``name_or_path`` came from) or one with real weights."""
    path = getattr(model, PRETRAINED_ATTR, None)
    if not path or not any(p.is_meta for p in model.parameters()):
        return None
    if not any((Path(path) / name).exists() for name in (SINGLE_FILE, INDEX_FILE)):
        raise FileNotFoundError(f"{type(model).__name__} was loaded from {path!r} on the meta "
                                f"device, but {path} holds no {SINGLE_FILE} or {INDEX_FILE} to "
                                f"load each rank's shard from (a hub id must be downloaded "
                                f"first)")
    return path
