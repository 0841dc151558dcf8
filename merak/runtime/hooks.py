"""Instruction hooks: how timers, the timeline recorder and the energy client observe the
interpreter without touching its handlers."""

from __future__ import annotations

import time

import torch.distributed as dist

from merak.schedule.actions import Action
from merak.schedule.timeline import TimelineEvent


class InstructionHook:
    """Base class; override what you need. `name` is the instruction name (`Action.name`:
    "forward", "backward", "send_act", ...), `action` carries the micro-batch id."""

    def on_step_begin(self, step: int) -> None:
        pass

    def on_instruction_begin(self, name: str, action: Action) -> None:
        pass

    def on_instruction_end(self, name: str, action: Action) -> None:
        pass

    def on_step_end(self, step: int) -> None:
        pass


class TimelineRecorder(InstructionHook):
    """Records the actions of the most recent step on this rank."""

    def __init__(self, row: int):
        self.row = row
        self.events: list[TimelineEvent] = []
        self._step_start = 0.0
        self._open: dict[Action, float] = {}

    def on_step_begin(self, step: int) -> None:
        self.events = []
        self._step_start = time.perf_counter()

    def on_instruction_begin(self, name: str, action: Action) -> None:
        self._open[action] = time.perf_counter() - self._step_start

    def on_instruction_end(self, name: str, action: Action) -> None:
        start = self._open.pop(action)
        self.events.append(TimelineEvent(self.row, name, action.microbatch_id, start,
                                         time.perf_counter() - self._step_start))


def gather_events(events: list[TimelineEvent], dst: int = 0) -> list[TimelineEvent] | None:
    """Collect every rank's events on rank `dst` (others get None)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(events)
    gathered: list[list[TimelineEvent]] | None = (
        [None] * dist.get_world_size() if dist.get_rank() == dst else None)  # type: ignore
    dist.gather_object(events, gathered, dst=dst)
    return None if gathered is None else [e for rank_events in gathered for e in rank_events]
