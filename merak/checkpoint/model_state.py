"""The model's weights in a checkpoint, on torch.distributed.checkpoint (DCP), resharded on load
into any layout. Every parameter and persistent buffer of a stage is stored under its name (the
stage's ``named_parameters()``: the user's model's names) as the whole logical tensor. Each rank
describes the boxes of it it holds (`merak.checkpoint.sharded`: tensor-parallel parts, ZeRO-2/3
rows, expert-parallel ranges of experts); DCP writes each box once (replicas over dp and cp, and
the copies of a tied weight on two stages, are written by one rank) with its offsets in the
whole tensor. A resume in any (dp, tp, pp, cp, ep) layout, schedule, stage placement or ZeRO
stage reads for each rank just the slices its own parameters need, straight into them;
`read_whole_tensors` rebuilds whole tensors in one process (``merak export``) without a process
group.

`missing_model_files` (`merak.checkpoint.files`) is what a reader checks before trusting the
directory: DCP's ``.metadata`` (written by the coordinator once every rank has written) and
every data file it points at, each at least as long as the bytes it is said to hold.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from merak.checkpoint import sharded
from merak.checkpoint.files import (
    IncompleteCheckpointError,
    dcp_metadata,
    listed,
    missing_model_files,
)
from merak.checkpoint.sharded import pieces_of, shard_spec


def persistent_buffers(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's buffers that a state_dict (and so HF's save_pretrained) holds, by name:
    DeepSeek-V3's ``mlp.gate.e_score_correction_bias``. Non-persistent ones (rotary
    ``inv_freq``) are rebuilt by the model and stay out. Saved and loaded beside the
    parameters (never sharded)."""
    params = dict(stage.named_parameters(remove_duplicate=False))
    return {n: t for n, t in stage.state_dict(keep_vars=True).items() if n not in params}


def _tensors(stage: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(stage.named_parameters()), **persistent_buffers(stage)}


def model_entries(stage: nn.Module, copy: bool = False) -> dict:
    """This rank's part of the stage's weights as `write_model_state` takes it: every
    parameter and persistent buffer as DCP should see it; with `copy` (a save in the
    background) host copies no later step changes."""
    return {name: pieces_of(tensor.detach(), shard_spec(tensor), copy=copy)
            for name, tensor in _tensors(stage).items()}


def write_model_state(path: Path, entries: dict, group=None) -> None:
    """Write `model_entries` to `path` (a collective of every rank of `group`, default the
    job's; in one process when no process group exists)."""
    sharded.save(path, entries, group, kind="model")


def tensor_shapes(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, whole shape) of every tensor at `path`, from the metadata alone."""
    saved = dcp_metadata(Path(path)).state_dict_metadata
    return {name: (meta.properties.dtype, tuple(meta.size)) for name, meta in saved.items()
            if isinstance(meta, TensorStorageMetadata)}


def _check_names(path: Path, wanted, saved) -> None:
    missing = [name for name in wanted if name not in saved]
    if missing:
        raise IncompleteCheckpointError(
            f"checkpoint {path.parent} has no tensor {listed(missing)} "
            f"(saved from another model, or with other parameters?)")


def _check_files(path: Path) -> None:
    missing = missing_model_files(path)
    if missing:
        raise IncompleteCheckpointError(f"{path.parent} is incomplete: it lacks "
                                        f"{', '.join(missing)}")


def load_model_state(path: Path, stage: nn.Module) -> None:
    """Fill this rank's parameters and persistent buffers in place from the weights at
    `path`, saved in any layout (a collective of every rank of the job).

    Raises:
        IncompleteCheckpointError: a file is missing or cut short, or the checkpoint lacks a
            tensor this rank holds (their names).
    """
    path = Path(path)
    _check_files(path)
    tensors = _tensors(stage)
    _check_names(path, tensors, tensor_shapes(path))
    entries = {name: pieces_of(tensor.detach(), shard_spec(tensor),
                               for_load=True) for name, tensor in tensors.items()}
    sharded.load(path, entries)


def read_whole_tensors(path: Path, names=None) -> dict[str, torch.Tensor]:
    """Whole tensors from the weights at `path`, in this process alone (no collective, also
    inside a job): `names` only (default: all). Errors name a missing file or tensor."""
    path = Path(path)
    _check_files(path)
    shapes = tensor_shapes(path)
    if names is not None:
        _check_names(path, names, shapes)
    out = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in shapes.items()
           if names is None or name in names}
    if out:
        sharded.load(path, out, alone=True)
    return out
