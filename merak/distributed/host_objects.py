"""Python objects between ranks through host memory, whatever the job's backend.

Why not torch's object collectives (`gather_object`, `all_gather_object`, `broadcast_object_list`):
they pickle on the group's device. On NCCL every payload is staged on the current GPU, and a
receiver allocates world size times the largest payload there, all at once: rank 0 of a model export
held every rank's shard on its GPU. Objects live on the host, so they travel through the host here:
over a gloo group kept beside an NCCL job (`ParallelContext.host_group`; the mesh's own groups where
its backend already moves CPU tensors), as pickled bytes in CPU tensors. A receiver taking several
payloads takes them one at a time (`receive_each`, `broadcast_object` per sender), so what it holds
beyond its result is one payload.

The groups are the context's (`ParallelContext.host_group`, made by `merak.init`); a function
given no group uses every rank's of the default context.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist

from merak.distributed.backends import handles_cpu_tensors
from merak.distributed.parallel_context import default_context


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """`group`, or every rank's host group: the default context's, or before any `merak.init`
    the default group where its backend moves CPU tensors."""
    if group is not None:
        return group
    if default_context() is not None:
        return default_context().host_group()
    if handles_cpu_tensors(dist.get_backend()):
        return dist.group.WORLD
    raise RuntimeError(f"objects between ranks travel over a gloo group, which merak.init makes "
                       f"beside a {dist.get_backend()!r} job: call merak.init first, or pass a "
                       f"gloo group")


def _pickled(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)


def _unpickled(data: torch.Tensor):
    return pickle.loads(memoryview(data.numpy()))


def _length(data: torch.Tensor | None = None) -> torch.Tensor:
    return torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)


def send_object(obj, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send `obj` to global rank `dst` (which calls `recv_object`)."""
    group = _group(group)
    data = _pickled(obj)
    dist.send(_length(data), dst, group=group)
    dist.send(data, dst, group=group)


def recv_object(src: int, group: dist.ProcessGroup | None = None):
    """The object global rank `src` sends with `send_object`."""
    group = _group(group)
    length = _length()
    dist.recv(length, src, group=group)
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return _unpickled(data)


def receive_each(obj, take: Callable[[int, object], None], dst: int = 0,
                 group: dist.ProcessGroup | None = None) -> None:
    """Gather to `dst` one sender at a time: on `dst`, ``take(rank, object)`` for every rank of
    `group` in rank order (its own `obj` included, not copied), each payload received only
    after the previous one was taken; the other ranks send `obj`. A collective of `group`."""
    group = _group(group)
    if dist.get_rank() != dst:
        send_object(obj, dst, group)
        return
    for rank in dist.get_process_group_ranks(group):
        take(rank, obj if rank == dst else recv_object(rank, group))


def gather_objects(obj, dst: int = 0, group: dist.ProcessGroup | None = None) -> list | None:
    """Every rank's `obj`, in rank order, on `dst` (None elsewhere); see `receive_each`."""
    gathered: list = []
    receive_each(obj, lambda _, value: gathered.append(value), dst, group)
    return gathered if dist.get_rank() == dst else None


def broadcast_object(obj, src: int, group: dist.ProcessGroup | None = None):
    """`obj` of global rank `src` on every rank of `group` (`src` gets its own back)."""
    group = _group(group)
    mine = dist.get_rank() == src
    data = _pickled(obj) if mine else None
    length = _length(data)
    dist.broadcast(length, src, group=group)
    if not mine:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(data, src, group=group)
    return obj if mine else _unpickled(data)


def all_gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's `obj`, in rank order, on every rank of `group`. For small objects
    (metadata, outcomes, token lists): each rank receives the group size times the largest
    payload at once."""
    group = _group(group)
    size = dist.get_world_size(group)
    data = _pickled(obj)
    lengths = [_length() for _ in range(size)]
    dist.all_gather(lengths, _length(data), group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return [_unpickled(part[:int(n.item())]) for part, n in zip(parts, lengths)]
