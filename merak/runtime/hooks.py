"""Instruction hooks: how timers, the timeline recorder and the energy client observe the
interpreter without touching its handlers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from merak.distributed.host_objects import gather_objects
from merak.runtime.device_timer import DeviceTimer
from merak.schedule.actions import Action
from merak.schedule.timeline import TimelineEvent


class InstructionHook:
    """Base class; override what you need. `name` is the instruction name (`Action.name`:
    "forward", "backward", "send_act", ...), `action` carries the micro-batch id.

    Sends and receives: the actions of one posting group all begin, the group is posted and its
    receives are waited for, then they all end. A send itself completes later, on the
    communication stream: the runtime waits for it at a later group or at the end of the step,
    before `on_step_end`. So a send's window is its posting (and its group's receives), not its
    transfer; a hook that must cover the transfer synchronises the device at its next boundary,
    which waits for every stream (the energy profiler's p2p window), or at `on_step_end`.
    """

    def on_step_begin(self, step: int) -> None:
        pass

    def on_instruction_begin(self, name: str, action: Action) -> None:
        pass

    def on_instruction_end(self, name: str, action: Action) -> None:
        pass

    def on_step_end(self, step: int) -> None:
        pass


class TimelineRecorder(InstructionHook):
    """Records the actions of the most recent step on this rank, timed on `device` (CUDA
    events on a GPU, read once at the step's end; see `DeviceTimer`). A send's bar is its
    posting (see `InstructionHook`)."""

    def __init__(self, row: int, device: torch.device | str | None = None):
        self.row = row
        self.events: list[TimelineEvent] = []
        self.timer = DeviceTimer(device)

    def on_step_begin(self, step: int) -> None:
        self.events = []
        self.timer.reset()

    def on_instruction_begin(self, name: str, action: Action) -> None:
        self.timer.begin(action)

    def on_instruction_end(self, name: str, action: Action) -> None:
        self.timer.end(action, (name, action.microbatch_id))

    def on_step_end(self, step: int) -> None:
        self.events = [TimelineEvent(self.row, name, mb, start, end)
                       for (name, mb), start, end in self.timer.intervals()]


def gather_events(events: list[TimelineEvent], dst: int = 0) -> list[TimelineEvent] | None:
    """Collect every rank's events on rank `dst` (others get None), through host memory
    (`merak.distributed.host_objects`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(events)
    gathered = gather_objects(events, dst=dst)
    return None if gathered is None else [e for rank_events in gathered for e in rank_events]
