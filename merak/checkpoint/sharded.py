"""A rank's part of a logical tensor, described to torch.distributed.checkpoint (DCP) as boxes of
the whole tensor, so that DCP writes each part once and reads, for any other layout, only the
slices a rank needs.

A parameter (or a per-parameter optimizer state tensor) of a Merak stage is cut in up to two
ways: tensor parallelism keeps, along one dimension, this rank's ``1/tp`` of each fused part
(`ShardSpec`: q, k and v each cut, not the fused whole), expert parallelism this rank's
range of experts along dim 0 (`ExpertSlice`, ``param.ep_shard``: read as a `ShardSpec` of one
part), or both (an `ExpertSlice` carrying the TP cut of its experts along another dim: a box
per TP part); and ZeRO-2/3 (FSDP2) keeps a range of rows of that shard (a DTensor sharded on dim 0
over the replicas). Neither is one DTensor placement of the whole tensor, but each is a union
of boxes (a box per fused part, cut to the rows FSDP keeps), which is what DCP's metadata
records for a chunked tensor (``ChunkStorageMetadata``: offsets and sizes). `Pieces`
implements the hooks DCP's default planners call for such objects (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``), as DTensor does for its one box.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class Box:
    """A box of the whole tensor (`offsets`, `sizes`) held at `local` in the rank's tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: tuple[int, ...]


def shard_spec(tensor: torch.Tensor):
    """How `tensor` (a stage's parameter or buffer) is cut out of the whole: its
    tensor-parallel `ShardSpec` (``tp_shard``), its expert-parallel `ExpertSlice`
    (``ep_shard``: the ep rank's experts, and their TP cut where tp splits them too), or None
    (held whole)."""
    spec = getattr(tensor, "ep_shard", None)
    return spec if spec is not None else getattr(tensor, "tp_shard", None)


def _segments(length: int, spec, dim: int) -> list[tuple[int, int, int]]:
    """(local start, whole start, length) of the runs along `dim` of a TP shard (or of an
    `ExpertSlice`, whose TP cut, if any, is along another dim)."""
    inner = getattr(spec, "tp", None)
    if inner is not None and inner.dim == dim:
        spec = inner
    if spec is None or spec.dim != dim:
        return [(0, 0, length)]
    out, local, whole = [], 0, 0
    for chunk in spec.chunks:
        per = chunk // spec.size
        out.append((local, whole + spec.rank * per, per))
        local, whole = local + per, whole + chunk
    return out


def boxes(tensor: torch.Tensor, spec=None) -> tuple[tuple[int, ...], list[Box]]:
    """(the whole tensor's shape, the boxes this rank holds) for `tensor`: a parameter or a
    state tensor shaped like one; `spec` its TP `ShardSpec` (None: not TP-sharded); a DTensor
    is the FSDP2 shard of rows of the TP shard."""
    shard_shape = tuple(tensor.shape)  # the TP shard's (a DTensor's global shape)
    rows = None
    if isinstance(tensor, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements)
        if any(o for o in offset[1:]) or tuple(local_shape[1:]) != shard_shape[1:]:
            raise NotImplementedError(f"a DTensor sharded other than by rows ({tensor.placements})"
                                      f" is not checkpointed by Merak")
        rows = (offset[0], local_shape[0]) if shard_shape else None
    whole = tuple(spec.full_shape) if spec is not None else shard_shape
    per_dim = [_segments(n, spec, d) for d, n in enumerate(shard_shape)]
    if rows is not None:  # keep the parts of dim 0 inside FSDP's rows, in local coordinates
        start, count = rows
        cut = []
        for local, full, length in per_dim[0]:
            lo, hi = max(local, start), min(local + length, start + count)
            if lo < hi:
                cut.append((lo - start, full + lo - local, hi - lo))
        per_dim[0] = cut
    found = [Box(tuple(s[1] for s in combo), tuple(s[2] for s in combo),
                 tuple(s[0] for s in combo))
             for combo in itertools.product(*per_dim)]
    return whole, found


class Pieces:
    """This rank's part of one logical tensor for DCP: `local` (plain, this rank's storage) and
    its `Box`es of the whole tensor of shape `whole`. For saving each box is handed out as a
    compact copy; for loading as a view, which DCP fills in place."""

    def __init__(self, local: torch.Tensor, whole: tuple[int, ...], found: list[Box],
                 for_load: bool = False, staged: bool = False):
        self.local, self.whole, self.found, self.for_load = local, whole, found, for_load
        self.staged = staged  # `local` is already this save's own host copy
        self._by_offsets = {box.offsets: box for box in found}

    def _view(self, box: Box) -> torch.Tensor:
        view = self.local
        for dim, (start, size) in enumerate(zip(box.local, box.sizes)):
            view = view.narrow(dim, start, size)
        return view

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(box.offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets),
                                                         sizes=torch.Size(box.sizes)),
                              properties=properties, size=torch.Size(self.whole)))
                for box in self.found]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
                for box in self.found]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        box = self._by_offsets.get(tuple(index.offset))
        if box is None:
            raise ValueError(f"{index.fqn}: this rank holds no box at {tuple(index.offset)}")
        view = self._view(box)
        if self.for_load:
            return view
        if self.staged:
            return view.contiguous()
        return view.detach().to("cpu", copy=True).contiguous()


def pieces_of(tensor: torch.Tensor, spec=None, for_load: bool = False,
              copy: bool = False) -> Pieces | torch.Tensor:
    """`tensor` as DCP should see it: a `Pieces` where it is a part of a larger tensor, the
    tensor itself (on CPU when saving) where the rank holds it whole. `copy` (saving): staged
    into a host copy of its own now, which later steps do not change."""
    whole, found = boxes(tensor, spec)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if not for_load and copy:
        local = local.detach().to("cpu", copy=True)
    if len(found) == 1 and tuple(local.shape) == whole:
        return local if for_load else local.detach().cpu()
    return Pieces(local, whole, found, for_load, staged=copy and not for_load)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which finds a box of a `Pieces` (its lookup hands boxes out
    only for tensors and DTensors)."""

    def lookup_object(self, index: MetadataIndex):
        found = self.state_dict.get(index.fqn)
        if isinstance(found, Pieces):
            return found.__get_tensor_shard__(index)
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which fills the boxes of a `Pieces` in place. It takes a
    flat state dict (its preparation drops objects it does not know; they are put back)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        kept = {key: value for key, value in state_dict.items() if isinstance(value, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(kept)
        self.state_dict.update(kept)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, Pieces):
            return found.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _in_one_process(alone: bool):
    """DCP warns on every call in one process that it assumes one process: it is meant."""
    if not alone:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(path, entries: dict, group=None, kind: str = "state") -> None:
    """Write `entries` (tensors and `Pieces`) to the directory `path` with DCP, one file per
    rank: a collective of every rank of `group` (default the job's), or in this process alone
    when no process group exists. DCP keeps the plans of the last save of each `kind` and
    skips planning again when they are unchanged (a run saving the same state every N steps)."""
    alone = _no_dist()
    planner = SavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = f"merak-{kind}"  # (DCP keys its cache by class name)
    with _in_one_process(alone):
        dcp.save(entries, planner=planner, process_group=group, no_dist=alone,
                 storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=True))


def load(path, entries: dict, *, alone: bool | None = None) -> None:
    """Fill `entries` (a flat dict of tensors and `Pieces`) in place from the directory `path`:
    a collective of every rank of the job, unless `alone` (default: when no process group
    exists) reads in this process only."""
    alone = _no_dist() if alone is None else alone
    with torch.no_grad(), _in_one_process(_no_dist()):
        dcp.load(entries, storage_reader=dcp.FileSystemReader(str(path)), planner=LoadPlanner(),
                 no_dist=alone)
