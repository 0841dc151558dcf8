"""Process groups that live only as long as one piece of work (a planner's dry run).

Every `merak.init` builds a new `DeviceMesh`, which creates a process group per mesh dimension
(and `tied_weight_groups` one per set of pipeline ranks sharing weights); torch.distributed
keeps each until it is destroyed. An NCCL communicator holds device memory outside the caching
allocator (its buffers, its channels' FIFOs), so a planner that dry-runs candidate after
candidate, each under a new mesh, fills the GPU with the dead candidates' communicators and
judges the later candidates in less memory than training will have. `transient_process_groups`
destroys, at the end of such a piece of work, exactly the groups it created. (On CPU, each live
gloo group holds two native threads and a TCP loop that wakes every 10 ms.)

Destroying groups is not enough on its own. A `DeviceMesh` compares equal to (and hashes like)
any other mesh of the same ranks and dimension names, and DTensor caches what it decides per
mesh: the sharding propagation (in Python and in its C++ fast path), the tensor metadata, the
redistribution plans. A later mesh of the same layout would be handed the destroyed mesh's
entries, and its collectives would run on groups that no longer exist ("Could not resolve the
process group"). `release_process_groups` therefore clears those caches with the groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from merak.distributed import parallel_context


@contextlib.contextmanager
def transient_process_groups() -> Iterator[None]:
    """Destroy every process group created inside (this rank's member groups: a rank holds no
    other), newest first, after a barrier of all ranks, and make the default context
    (`merak.get_context()`) the one from before again: the contexts built inside point to
    destroyed groups.

    Every rank must enter and leave together (a collective). On an exception nothing is
    destroyed (the peers may still be inside, waiting on those groups); the default context is
    restored all the same. The default (world) group is never destroyed, even when created
    inside (a first `merak.init`).
    """
    before = set(_world.pg_map)
    previous = parallel_context.default_context()
    try:
        yield
        created = [group for group in _world.pg_map
                   if group not in before and group is not dist.GroupMember.WORLD]
        if dist.is_initialized():
            dist.barrier()  # no peer still uses them (every rank: some may have made none)
        release_process_groups(created)
    finally:
        parallel_context.restore_default_context(previous)


def release_process_groups(groups: list) -> None:
    """Destroy `groups` (this rank's, none of them the world), newest last in the list, destroyed
    newest first, then forget what DTensor cached about meshes: see the module docstring. Every
    peer must be done with them (after a barrier): destroying a group is local."""
    for group in reversed(groups):  # (ncclCommAbort was collective in some NCCL versions)
        dist.destroy_process_group(group)
    if groups:
        clear_dtensor_caches()


def clear_dtensor_caches() -> None:
    """Empty DTensor's per-mesh caches (they only cost recomputation): the sharding propagation
    in Python (this thread's) and in the C++ fast path, the tensor metadata propagation, the
    redistribution transforms and planners, and the mesh topology of the collective cost model.
    Private torch names, each looked up defensively: a torch without one has nothing to clear
    there."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (getattr(propagator, "propagate_op_sharding", None),
                   getattr(propagator, "_propagate_tensor_meta_cached", None),
                   getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh",
                           None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()


def live_process_groups() -> int:
    """How many process groups this rank holds (its member groups, the world's included)."""
    return len(_world.pg_map)
