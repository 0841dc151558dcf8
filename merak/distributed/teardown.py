"""Process groups that live only as long as one piece of work (a planner's dry run).

Every `merak.init` builds a new `DeviceMesh`, which creates a process group per mesh dimension
(and `tied_weight_groups` one per set of pipeline ranks sharing weights); torch.distributed
keeps each until it is destroyed. An NCCL communicator holds device memory outside the caching
allocator (its buffers, its channels' FIFOs), so a planner that dry-runs candidate after
candidate, each under a new mesh, fills the GPU with the dead candidates' communicators and
judges the later candidates in less memory than training will have. `transient_process_groups`
destroys, at the end of such a piece of work, exactly the groups it created.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
        for group in reversed(created):  # (ncclCommAbort was collective in some NCCL versions)
            dist.destroy_process_group(group)
    finally:
        parallel_context.restore_default_context(previous)


def live_process_groups() -> int:
    """How many process groups this rank holds (its member groups, the world's included)."""
    return len(_world.pg_map)
