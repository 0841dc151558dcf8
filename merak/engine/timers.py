"""`wall_clock_breakdown`: time per instruction kind, averaged over the steps since last read.

Measured on the device (`DeviceTimer`: CUDA events read once per step on a GPU, the host clock
on CPU), so a GPU's kernels are timed, not their launches."""

from __future__ import annotations

from collections import defaultdict

import torch

from merak.runtime.device_timer import DeviceTimer
from merak.runtime.hooks import InstructionHook


class WallClockBreakdown(InstructionHook):
    def __init__(self, device: torch.device | str | None = None):
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.timer = DeviceTimer(device)

    def on_step_begin(self, step: int) -> None:
        self.timer.reset()

    def on_instruction_begin(self, name: str, action) -> None:
        self.timer.begin(action)

    def on_instruction_end(self, name: str, action) -> None:
        self.timer.end(action, name)

    def on_step_end(self, step: int) -> None:
        for name, start, end in self.timer.intervals():
            self.totals[name] += end - start
        self.timer.reset()
        self.steps += 1

    def averages(self) -> dict[str, float]:
        """``{"time_<kind>_ms": mean per step}`` since the last call, then reset."""
        steps = max(self.steps, 1)
        out = {f"time_{k}_ms": round(v * 1e3 / steps, 2) for k, v in sorted(self.totals.items())}
        self.totals.clear()
        self.steps = 0
        return out
