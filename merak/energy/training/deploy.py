"""Run a frequency plan from the interpreter's instruction hooks, and measure every step.

`ClockPlanHook` sets the GPU clock before each compute instruction (forward, backward,
recompute, backward_input, backward_weight) from this rank's FrequencySchedule, checking the
instruction name matches (as Zeus's client does) and that the step consumed the schedule exactly
once: at each such boundary it synchronises the device, then sets the clock, so the work still
queued (the previous instruction, communication in flight) finishes at the clock it was planned
for.

Without a schedule it only measures (the baseline): it sets no clock and adds no wait between
instructions, so the measured run is the unmodified one (the GPU picks its own clocks); time and
energy are read per step, after one synchronisation at each end of the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from merak.energy.planning.plan_file import ClockPlanError
from merak.energy.profiling.gpu import GPUControl
from merak.energy.profiling.profile_data import COMPUTE
from merak.runtime.hooks import InstructionHook
from merak.schedule.actions import Action


@dataclass
class StepMeasurement:
    step: int
    time_s: float     # this rank's step, first instruction to the end of the step
    energy_j: float   # this rank's GPU energy over the step


class ClockPlanHook(InstructionHook):
    """Follow `frequencies` (``[(instruction, MHz), ...]`` per step) on `gpu`.

    Args:
        gpu: the `GPUControl` of this rank.
        frequencies: this rank's schedule, in program order; None measures only (the
            baseline: no clock set, no per-instruction synchronisation).
        pp_rank: this rank's pipeline rank (the simulated GPU times instructions by rank).
    """

    def __init__(self, gpu: GPUControl, frequencies: list[tuple[str, int]] | None,
                 pp_rank: int):
        self.gpu, self.frequencies, self.pp_rank = gpu, frequencies, pp_rank
        self.steps: list[StepMeasurement] = []
        self.consumed: list[int] = []  # compute instructions each step ran (the plan's length)
        self._cursor = 0
        self._start = self._energy = 0.0

    def on_step_begin(self, step: int) -> None:
        self._cursor = 0
        self.gpu.synchronize()  # the step's window starts with an idle device
        self._start, self._energy = time.perf_counter(), self.gpu.energy_j()

    def on_instruction_begin(self, name: str, action: Action) -> None:
        if name not in COMPUTE:
            return
        if self.frequencies is not None:
            if self._cursor >= len(self.frequencies):
                raise ClockPlanError(f"pipeline rank {self.pp_rank} runs more compute instructions "
                                     f"per step than its plan has ({len(self.frequencies)})")
            planned, mhz = self.frequencies[self._cursor]
            if planned != name:
                raise ClockPlanError(f"pipeline rank {self.pp_rank}: instruction {self._cursor} of "
                                     f"the step is {name} ({action}), the plan says {planned}")
            self.gpu.synchronize()  # what is queued finishes at the clock planned for it
            self.gpu.set_clock(mhz)
        self._cursor += 1
        self.gpu.instruction_begin(name, self.pp_rank)

    def on_instruction_end(self, name: str, action: Action) -> None:
        if name in COMPUTE:
            self.gpu.instruction_end(name, self.pp_rank)

    def on_step_end(self, step: int) -> None:
        if self.frequencies is not None and self._cursor != len(self.frequencies):
            raise ClockPlanError(f"pipeline rank {self.pp_rank} ran {self._cursor} compute "
                                 f"instructions this step, its plan has {len(self.frequencies)}")
        self.consumed.append(self._cursor)
        self.gpu.synchronize()  # the step's work, sends included, is in its window
        self.steps.append(StepMeasurement(step, time.perf_counter() - self._start,
                                          self.gpu.energy_j() - self._energy))
