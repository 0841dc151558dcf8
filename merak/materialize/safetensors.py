"""Load only this rank's tensors from an HF safetensors checkpoint, straight into their storage.

Reads the safetensors header (8-byte length + JSON) and `readinto`s each wanted tensor's bytes
into the parameter's own memory: no second copy of the tensor is ever allocated when dtypes
match, which keeps a rank's peak memory at its own share of the model (safetensors'
`get_tensor` allocates a fresh tensor per read). A tensor on a GPU (or needing a dtype change or
a tensor-parallel slice) is read into host memory once and copied over.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

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
                      names: Iterable[str] | None = None) -> list[str]:
    """Fill `module`'s parameters and persistent buffers (or only `names`) from `path`, in place.

    Args:
        module: a module whose tensor names are the checkpoint's names (a pipeline stage is).
        path: a ``.safetensors`` file or an HF checkpoint directory.
        aliases: other names a tensor may be stored under (tied weights: HF stores one of
            ``lm_head.weight`` / ``embed_tokens.weight``).
        names: the tensor names to load; default every parameter, and every buffer the
            checkpoint has (others, like rotary ``inv_freq``, keep the values they were built
            with).

    Raises:
        KeyError: a wanted tensor is in the checkpoint under none of its names.
        ValueError: a stored shape differs from the module's.
    """
    index = checkpoint_index(path)
    params = dict(module.named_parameters(remove_duplicate=False))
    tensors = {**module.state_dict(keep_vars=True), **params}
    aliases = aliases or {}
    if names is None:  # buffers absent from the checkpoint were non-persistent in the model
        names = [n for n in tensors if n in params
                 or any(a in index for a in [n, *aliases.get(n, ())])]
    wanted = list(dict.fromkeys(names))
    plan: dict[Path, list[tuple[str, str]]] = {}
    missing = []
    for name in wanted:
        stored = next((n for n in [name, *aliases.get(name, ())] if n in index), None)
        if stored is None:
            missing.append(name)
        else:
            plan.setdefault(index[stored], []).append((name, stored))
    if missing:
        raise KeyError(f"{len(missing)} tensors are not in the checkpoint {path}: {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}")
    for file, entries in plan.items():
        data_start, header = read_header(file)
        with open(file, "rb") as f:
            for name, stored in entries:
                _read_into(f, data_start, header[stored], tensors[name], name, file)
    return wanted


def _read_into(f, data_start: int, info: dict, tensor: torch.Tensor, name: str,
               file: Path) -> None:
    shape = tuple(info["shape"])
    spec = getattr(tensor, "tp_shard", None)  # a tensor-parallel shard: read whole, keep a slice
    if shape != (spec.full_shape if spec else tuple(tensor.shape)):
        raise ValueError(f"{name}: the checkpoint {file} stores shape {list(shape)}, the model "
                         f"has {list(spec.full_shape if spec else tensor.shape)}")
    dtype = _DTYPES[info["dtype"]]
    begin, end = info["data_offsets"]
    f.seek(data_start + begin)
    with torch.no_grad():
        target = tensor.data
        if spec is None and dtype == target.dtype and target.is_contiguous() \
                and target.device.type == "cpu":
            view = target.view(-1).view(torch.uint8).numpy()
            if f.readinto(view) != end - begin:
                raise ValueError(f"{name}: the checkpoint {file} is truncated")
            return
        raw = bytearray(end - begin)
        f.readinto(raw)
        stored = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        stored = stored.view(shape)
        target.copy_(spec.take(stored) if spec else stored)
