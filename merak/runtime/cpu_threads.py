"""Lend idle cores to the stage that computes alone (CPU training on one host).

Ranks on one machine share its cores, so each gets ``cores // local_ranks`` intra-op threads.
In a pipeline's warm-up and drain, and while one stage waits for another's backward, only some
ranks compute: their neighbours' cores sit idle. The schedule is data, so the simulator says
ahead of time which compute actions run alone; this hook gives those actions the idle cores too
and restores the share afterwards.
"""

from __future__ import annotations

import os

import torch

from merak.runtime.hooks import InstructionHook
from merak.schedule.actions import COMPUTE_KINDS, Action, Schedule
from merak.schedule.simulator import CostModel, simulate


def threads_per_rank(cores: int | None = None, local_ranks: int | None = None) -> int:
    """This rank's share of the host's cores (LOCAL_WORLD_SIZE ranks share `os.cpu_count()`)."""
    cores = cores or os.cpu_count() or 1
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // local_ranks)


def concurrent_ranks(schedule: Schedule, costs: CostModel | None = None
                     ) -> dict[tuple[int, Action], int]:
    """For each compute action, how many ranks compute while it runs (its own included)."""
    events = [e for e in simulate(schedule, costs).events if e.action.kind in COMPUTE_KINDS]
    counts = {}
    for e in events:
        others = {o.rank for o in events
                  if o.rank != e.rank and o.start < e.end - 1e-9 and e.start < o.end - 1e-9}
        counts[(e.rank, e.action)] = 1 + len(others)
    return counts


class IdleCoreLending(InstructionHook):
    """Sets intra-op threads per compute action from the simulated concurrency of `schedule`.

    Args:
        schedule: the programs every rank runs.
        pp_rank: this rank's pipeline rank.
        ranks_per_stage: ranks running each pipeline rank's program at once (dp * tp).
        cores: cores of this host; default `os.cpu_count()`.
        local_ranks: ranks on this host; default LOCAL_WORLD_SIZE.

    Construction sets this process's intra-op threads to its share, ``cores // local_ranks``.
    """

    def __init__(self, schedule: Schedule, pp_rank: int, ranks_per_stage: int,
                 cores: int | None = None, local_ranks: int | None = None):
        cores = cores or os.cpu_count() or 1
        self.base_threads = threads_per_rank(cores, local_ranks)
        self.threads: dict[Action, int] = {}
        for (rank, action), count in concurrent_ranks(schedule).items():
            threads = max(1, cores // (count * ranks_per_stage))
            if rank == pp_rank and threads > self.base_threads:
                self.threads[action] = threads
        torch.set_num_threads(self.base_threads)

    def on_instruction_begin(self, name: str, action: Action) -> None:
        if action in self.threads:
            torch.set_num_threads(self.threads[action])

    def on_instruction_end(self, name: str, action: Action) -> None:
        if action in self.threads:
            torch.set_num_threads(self.base_threads)
