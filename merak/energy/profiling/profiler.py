"""Profile time and energy of every compute instruction at each GPU clock, during training.

One training step per clock, highest first, after warm-up steps at the highest clock: every
compute instruction of the step (forward, backward, recompute, backward_input, backward_weight)
runs at that clock and is measured (wall time, energy-counter delta), averaged per instruction
kind (a rank's model chunks alike); the time between them, when the rank is blocked on
communication, gives the p2p power.
Profiling stops early once the mean instruction energy has risen for `patience` clocks in a row
on every rank (lower clocks only get slower and costlier from there).

At every boundary of a compute instruction the order is: synchronise the device, read the host
clock and the energy counter, then (at a beginning) set the instruction's clock. Reading before
the device is idle would leave the work still queued (the previous instruction's kernels, a
communication in flight) in the wrong window; setting the clock before waiting would run that
work at the new clock. Sends are posted by the interpreter and complete later on the
communication stream (the runtime waits for them at a later group or at the step's end), so a
send's own hook window covers its posting only; its transfer is measured here all the same,
in the p2p window: the synchronisation that opens the next compute instruction waits for it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from merak.distributed.host_objects import all_gather_objects
from merak.energy.profiling.gpu import GPUControl
from merak.energy.profiling.profile_data import COMPUTE, ProfileRow
from merak.runtime.hooks import InstructionHook
from merak.schedule.actions import Action


class ClockProfiler(InstructionHook):
    """Measures each compute instruction at the clock `clock` (set before each step)."""

    def __init__(self, gpu: GPUControl, pp_rank: int):
        self.gpu, self.pp_rank = gpu, pp_rank
        self.clock: int | None = None  # None: warm-up, nothing recorded
        self.samples: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
        self.blocked = [0.0, 0.0]  # seconds, joules between instructions
        self._begin = self._energy = 0.0
        self._idle_since: tuple[float, float] | None = None

    def on_step_begin(self, step: int) -> None:
        self._idle_since = None

    def _read(self) -> tuple[float, float]:
        """The boundary: wait for the device, then read time and energy (see the module doc)."""
        self.gpu.synchronize()
        return time.perf_counter(), self.gpu.energy_j()

    def on_instruction_begin(self, name: str, action: Action) -> None:
        if name not in COMPUTE:
            return
        now, energy = self._read()
        if self._idle_since is not None and self.clock is not None:
            self.blocked[0] += now - self._idle_since[0]
            self.blocked[1] += energy - self._idle_since[1]
        self.gpu.set_clock(self.clock or max(self.gpu.supported_clocks()))
        self.gpu.instruction_begin(name, self.pp_rank)
        self._begin, self._energy = now, energy

    def on_instruction_end(self, name: str, action: Action) -> None:
        if name not in COMPUTE:
            return
        self.gpu.instruction_end(name, self.pp_rank)  # the simulated GPU's work ends here
        now, energy = self._read()
        if self.clock is not None:
            self.samples[(name, self.clock)].append((now - self._begin, energy - self._energy))
        self._idle_since = (now, energy)

    def mean_energy(self, clock: int) -> float:
        values = [e for (_, f), samples in self.samples.items() if f == clock
                  for _, e in samples]
        return sum(values) / len(values) if values else 0.0

    def rows(self, rank: int, dp_rank: int, pp_rank: int, tp_rank: int) -> list[ProfileRow]:
        where = (rank, dp_rank, pp_rank, tp_rank, pp_rank)
        rows = []
        for (name, clock), samples in sorted(self.samples.items(), key=lambda kv: (kv[0][0],
                                                                                 -kv[0][1])):
            rows.append(ProfileRow(*where, name, clock, sum(t for t, _ in samples) / len(samples),
                                   sum(e for _, e in samples) / len(samples)))
        if self.blocked[0] > 0:
            rows.append(ProfileRow(*where, "p2p", 0, self.blocked[0], self.blocked[1]))
        return rows


def profile_clocks(step: Callable[[], None], profiler: ClockProfiler, ctx,
                   warmup_steps: int = 1, patience: int = 2,
                   clocks: list[int] | None = None) -> list[ProfileRow]:
    """Run `step()` (one training step with `profiler` among the interpreter's hooks) at each
    clock, highest first, and return every rank's rows (on every rank)."""
    clocks = sorted(clocks or profiler.gpu.supported_clocks(), reverse=True)
    profiler.clock = None
    for _ in range(warmup_steps):
        step()
    rising, previous = 0, None
    for clock in clocks:
        profiler.clock = clock
        step()
        energy = profiler.mean_energy(clock)
        rising = rising + 1 if previous is not None and energy > previous else 0
        previous = energy
        done = torch.tensor([int(rising >= patience)], device=ctx.device)  # NCCL: no CPU tensors
        if ctx.world_size > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            break
    profiler.gpu.reset_clock()
    rows = profiler.rows(ctx.rank, ctx.dp_rank, ctx.pp_rank, ctx.tp_rank)
    if ctx.world_size == 1:
        return rows
    return [row for part in all_gather_objects(rows) for row in part]  # through host memory
