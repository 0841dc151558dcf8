"""`wall_clock_breakdown`: time per instruction kind, averaged over the steps since last read."""

from __future__ import annotations

import time
from collections import defaultdict

from merak.runtime.hooks import InstructionHook


class WallClockBreakdown(InstructionHook):
    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._start = 0.0

    def on_instruction_begin(self, name: str, action) -> None:
        self._start = time.perf_counter()

    def on_instruction_end(self, name: str, action) -> None:
        self.totals[name] += time.perf_counter() - self._start

    def on_step_end(self, step: int) -> None:
        self.steps += 1

    def averages(self) -> dict[str, float]:
        """``{"time_<kind>_ms": mean per step}`` since the last call, then reset."""
        steps = max(self.steps, 1)
        out = {f"time_{k}_ms": round(v * 1e3 / steps, 2) for k, v in sorted(self.totals.items())}
        self.totals.clear()
        self.steps = 0
        return out
