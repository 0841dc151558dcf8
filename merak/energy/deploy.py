"""Run a frequency plan from the interpreter's instruction hooks, and measure every step.

`ClockPlanHook` sets the GPU clock before each forward / backward from this rank's
FrequencySchedule, checking the instruction name matches (as Zeus's client does) and that the
step consumed the schedule exactly once. With a constant clock it is the measurement baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from merak.energy.gpu import GPUControl
from merak.energy.plan_file import PlanError
from merak.energy.profile_data import COMPUTE
from merak.pipeline.actions import Action
from merak.pipeline.hooks import InstructionHook


@dataclass
class StepMeasurement:
    step: int
    time_s: float     # this rank's step, first instruction to the end of the step
    energy_j: float   # this rank's GPU energy over the step


class ClockPlanHook(InstructionHook):
    """Follow `frequencies` (``[(instruction, MHz), ...]`` per step) on `gpu`.

    Args:
        gpu: the `GPUControl` of this rank.
        frequencies: this rank's schedule, in execution order; None runs every instruction at
            the highest clock (the baseline).
        stage_id: this rank's pipeline stage (the simulated GPU times instructions by stage).
    """

    def __init__(self, gpu: GPUControl, frequencies: list[tuple[str, int]] | None,
                 stage_id: int):
        self.gpu, self.frequencies, self.stage_id = gpu, frequencies, stage_id
        self.max_clock = max(gpu.supported_clocks())
        self.steps: list[StepMeasurement] = []
        self._cursor = 0
        self._start = self._energy = 0.0

    def on_step_begin(self, step: int) -> None:
        self._cursor = 0
        self._start, self._energy = time.perf_counter(), self.gpu.energy_j()

    def on_instruction_begin(self, name: str, action: Action) -> None:
        if name not in COMPUTE:
            return
        mhz = self.max_clock
        if self.frequencies is not None:
            if self._cursor >= len(self.frequencies):
                raise PlanError(f"stage {self.stage_id} runs more compute instructions per step "
                                f"than its plan has ({len(self.frequencies)})")
            planned, mhz = self.frequencies[self._cursor]
            if planned != name:
                raise PlanError(f"stage {self.stage_id}: instruction {self._cursor} of the step "
                                f"is {name} ({action}), the plan says {planned}")
        self._cursor += 1
        self.gpu.set_clock(mhz)
        self.gpu.instruction_begin(name, self.stage_id)

    def on_instruction_end(self, name: str, action: Action) -> None:
        if name in COMPUTE:
            self.gpu.instruction_end(name, self.stage_id)

    def on_step_end(self, step: int) -> None:
        if self.frequencies is not None and self._cursor != len(self.frequencies):
            raise PlanError(f"stage {self.stage_id} ran {self._cursor} compute instructions "
                            f"this step, its plan has {len(self.frequencies)}")
        self.steps.append(StepMeasurement(step, time.perf_counter() - self._start,
                                          self.gpu.energy_j() - self._energy))
