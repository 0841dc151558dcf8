"""Instruction hooks: how timers, the timeline recorder and the energy client observe the
interpreter without touching its handlers."""

from __future__ import annotations

from merak.pipeline.actions import Action


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
