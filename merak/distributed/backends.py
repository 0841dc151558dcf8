"""Which process groups move which tensors: NCCL, gloo and per-device backend strings, and
the gloo groups `ParallelContext.host_group` uses for objects in host memory beside NCCL."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def is_nccl(backend: str) -> bool:
    """NCCL alone, or in a per-device backend string such as ``cpu:gloo,cuda:nccl``."""
    return "nccl" in str(backend).lower()


def handles_cpu_tensors(backend: str) -> bool:
    """Whether a process group of `backend` takes CPU tensors (gloo, alone or in a per-device
    string such as ``cpu:gloo,cuda:nccl``)."""
    backend = str(backend).lower()
    return "gloo" in backend or not is_nccl(backend)


def make_host_groups(mesh: DeviceMesh, backend: str) -> dict[str, dist.ProcessGroup]:
    """The groups of `ParallelContext.host_group`: the mesh's own and the world where
    `backend` moves CPU tensors; else new gloo groups (every rank creates every group of each
    dimension, in one order, as `new_group` requires)."""
    if handles_cpu_tensors(backend):
        return {"world": dist.group.WORLD,
                **{dim: mesh.get_group(dim) for dim in mesh.mesh_dim_names}}
    groups = {"world": dist.new_group(backend="gloo")}
    for index, dim in enumerate(mesh.mesh_dim_names):
        lines = mesh.mesh.movedim(index, -1).reshape(-1, mesh.size(index))
        groups[dim], _ = dist.new_subgroups_by_enumeration([row.tolist() for row in lines],
                                                           backend="gloo")
    return groups
