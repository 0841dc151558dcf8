"""GPU clock control behind one small interface: NVML for NVIDIA GPUs, a simulated GPU for CPU.

`GPUControl` is all the profiler and the plan deployment need: the supported clocks, locking
and unlocking the SM clock, a cumulative energy counter in joules, and waiting for the device.
Kernels run asynchronously to the host, so whoever reads the counter or changes the clock at an
instruction boundary first calls `synchronize` (then reads, then sets: see
`merak.energy.profiling.profiler`); the GPU itself never synchronises behind the caller's back.

`SimulatedGPU` stands in for a GPU on CPU machines. Each compute instruction has a reference
duration at the highest clock (`SyntheticGPUModel.reference_time`, by instruction kind and
pipeline rank); the simulated GPU makes the instruction really take that duration scaled by the
clock's slowdown, sleeping after the real (much shorter) CPU work, and charges the clock's power
for it. Time outside instructions is charged at the blocked-on-p2p power. So iteration time and
energy are measured on the wall clock, not assumed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from merak.energy.profiling.clock_guard import ClockGuard, process_guard


class GPUControl(ABC):
    """Clock control and energy reading of one GPU."""

    @abstractmethod
    def supported_clocks(self) -> list[int]:
        """SM clocks in MHz, highest first."""

    @abstractmethod
    def set_clock(self, mhz: int) -> None:
        """Lock the SM clock to `mhz` (one of `supported_clocks()`)."""

    @abstractmethod
    def reset_clock(self) -> None:
        """Undo `set_clock`: let the GPU pick its clock again."""

    @abstractmethod
    def energy_j(self) -> float:
        """Energy drawn since an arbitrary origin, in joules."""

    def synchronize(self) -> None:
        """Wait until the work queued on this GPU (every stream: communication kernels too)
        has finished, so the host clock and the energy counter cover it. Nothing to wait for
        by default (the simulated GPU's work is done when `instruction_end` returns)."""

    # Instruction brackets: a real GPU needs none; the simulated one does its timing here.
    def instruction_begin(self, name: str, pp_rank: int) -> None:
        """A compute instruction (`forward`, `backward`, `recompute`, `backward_input`,
        `backward_weight`) of pipeline rank `pp_rank` is about to run."""

    def instruction_end(self, name: str, pp_rank: int) -> None:
        """The compute instruction started by `instruction_begin` has finished."""

    def check_clock(self, mhz: int) -> None:
        if mhz not in self.supported_clocks():
            clocks = self.supported_clocks()
            raise ValueError(f"{mhz} MHz is not a supported clock of this GPU; supported: "
                             f"{clocks[0]}..{clocks[-1]} MHz ({len(clocks)} clocks)")


@dataclass(frozen=True)
class SyntheticGPUModel:
    """Frequency -> time and power of a GPU (defaults: the A100-like reference model).

    time(f) = reference_time * (compute_share * max_clock / f + (1 - compute_share))
    power(f) = static_w + dynamic_w * (f / max_clock) ** 3

    Reference times at max_clock, per micro-batch of a pipeline rank: `forward_s` for a forward
    (and a recompute, which reruns it, and a reference model's forward, ``reference_forward``),
    ``backward_ratio * forward_s`` for a backward, half of that for each of `backward_input`
    and `backward_weight` (zero-bubble's split backward); the
    last rank's are `last_stage_factor` longer (head and loss). A rank hosting `chunks` model
    chunks (interleaved schedules) spends 1/chunks of that on each chunk's instruction.
    """

    max_clock: int = 1410
    min_clock: int = 900
    clock_step: int = 15
    compute_share: float = 0.9
    static_w: float = 170.0
    dynamic_w: float = 230.0
    p2p_w: float = 75.0               # drawn while blocked on point-to-point communication
    forward_s: float = 0.040          # forward of one micro-batch at max_clock
    backward_ratio: float = 2.0       # backward time / forward time
    last_stage_factor: float = 1.15   # the last stage also computes the head and the loss
    switch_latency_s: float = 0.0     # a clock change takes this long

    def clocks(self) -> list[int]:
        return list(range(self.max_clock, self.min_clock - 1, -self.clock_step))

    def slowdown(self, mhz: float) -> float:
        return self.compute_share * self.max_clock / mhz + (1.0 - self.compute_share)

    def power(self, mhz: float) -> float:
        return self.static_w + self.dynamic_w * (mhz / self.max_clock) ** 3

    def reference_time(self, instruction: str, pp_rank: int, num_ranks: int,
                       chunks: int = 1) -> float:
        try:
            factor = {"forward": 1.0, "recompute": 1.0, "reference_forward": 1.0,
                      "backward": self.backward_ratio,
                      "backward_input": self.backward_ratio / 2,
                      "backward_weight": self.backward_ratio / 2}[instruction]
        except KeyError:
            raise ValueError(f"the synthetic GPU times compute instructions only, not "
                             f"{instruction!r}") from None
        last = self.last_stage_factor if pp_rank == num_ranks - 1 else 1.0
        return self.forward_s * factor * last / chunks

    def time(self, instruction: str, pp_rank: int, num_ranks: int, mhz: float,
             chunks: int = 1) -> float:
        return self.reference_time(instruction, pp_rank, num_ranks, chunks) * self.slowdown(mhz)

    def energy(self, instruction: str, pp_rank: int, num_ranks: int, mhz: float,
               chunks: int = 1) -> float:
        return self.time(instruction, pp_rank, num_ranks, mhz, chunks) * self.power(mhz)


class SimulatedGPU(GPUControl):
    """A GPU following `model`, timed on the wall clock (see the module docstring).

    Args:
        num_ranks: pipeline ranks of the job (the last one computes the head).
        chunks: model chunks per rank (interleaved schedules; each chunk's instruction takes
            1/chunks of the rank's).
    """

    def __init__(self, model: SyntheticGPUModel | None = None, num_ranks: int = 1,
                 chunks: int = 1, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.model = model or SyntheticGPUModel()
        self.num_ranks, self.chunks = num_ranks, chunks
        self._now, self._sleep = clock, sleep
        self.clock_mhz = self.model.max_clock
        self._energy = 0.0
        self._since = self._now()       # start of the interval not yet charged
        self._running: tuple[float, float] | None = None  # (start, duration) of the instruction
        self.ran: Counter[tuple[str, int]] = Counter()  # instructions run, by (name, clock)

    def supported_clocks(self) -> list[int]:
        return self.model.clocks()

    def set_clock(self, mhz: int) -> None:
        self.check_clock(mhz)
        if mhz != self.clock_mhz and self.model.switch_latency_s > 0:
            self._sleep(self.model.switch_latency_s)
        self.clock_mhz = mhz

    def reset_clock(self) -> None:
        self.clock_mhz = self.model.max_clock

    def _charge_idle(self, until: float) -> None:
        self._energy += max(0.0, until - self._since) * self.model.p2p_w
        self._since = max(self._since, until)

    def energy_j(self) -> float:
        if self._running is None:
            self._charge_idle(self._now())
        return self._energy

    def instruction_begin(self, name: str, pp_rank: int) -> None:
        start = self._now()
        self._charge_idle(start)
        self.ran[(name, self.clock_mhz)] += 1
        self._running = (start, self.model.time(name, pp_rank, self.num_ranks, self.clock_mhz,
                                                self.chunks))

    def instruction_end(self, name: str, pp_rank: int) -> None:
        if self._running is None:
            raise RuntimeError(f"instruction_end({name!r}) without instruction_begin")
        start, duration = self._running
        remaining = start + duration - self._now()
        if remaining > 0:
            self._sleep(remaining)
        end = max(self._now(), start + duration)
        self._energy += (end - start) * self.model.power(self.clock_mhz)
        self._since, self._running = end, None


def nvml_uuid(device) -> str:
    """NVML's UUID (``GPU-...``) of a torch CUDA device. NVML numbers GPUs in PCI order and
    ignores ``CUDA_VISIBLE_DEVICES``, so torch's index is not NVML's: the UUID is the same in
    both."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


class NVMLGPU(GPUControl):
    """An NVIDIA GPU through NVML (`pip install nvidia-ml-py`), found by its UUID (`nvml_uuid`).

    With `control`, locking clocks is probed at start (it needs root or ``nvidia-smi -acp
    UNRESTRICTED``; a clear `PermissionError` otherwise). While a clock is set, `guard` (the
    process's `ClockGuard` by default) resets the clocks at interpreter exit, on SIGTERM and
    SIGABRT, and from a watchdog process when this one is killed, as well as `reset_clock`
    does, so no ending of the job leaves the GPU locked. The energy counter needs Volta or
    newer."""

    def __init__(self, uuid: str, nvml=None, control: bool = True,
                 guard: ClockGuard | None = None):
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as error:
                raise ImportError("the NVML backend needs nvidia-ml-py: pip install "
                                  "nvidia-ml-py") from error
        self.nvml, self.uuid = nvml, uuid
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        memory = max(nvml.nvmlDeviceGetSupportedMemoryClocks(self.handle))
        self._clocks = sorted(nvml.nvmlDeviceGetSupportedGraphicsClocks(self.handle, memory),
                              reverse=True)
        self._guard = guard
        self._locked = False
        if control:
            try:  # the highest clock is what the GPU runs unlocked under load anyway
                nvml.nvmlDeviceSetGpuLockedClocks(self.handle, self._clocks[0], self._clocks[0])
                nvml.nvmlDeviceResetGpuLockedClocks(self.handle)
            except Exception as error:  # pynvml.NVMLError_NoPermission and relatives
                raise PermissionError(
                    f"cannot lock the clocks of GPU {uuid} ({error}): run as root or let users "
                    f"lock them (sudo nvidia-smi -acp UNRESTRICTED), or profile with "
                    f"energy_gpu='simulated'") from error

    def supported_clocks(self) -> list[int]:
        return list(self._clocks)

    def set_clock(self, mhz: int) -> None:
        self.check_clock(mhz)
        if not self._locked:  # the guard hears of it first: a kill in between is covered
            self._guard = self._guard or process_guard()
            self._guard.locking(self.uuid, self.reset_clock)
            self._locked = True
        self.nvml.nvmlDeviceSetGpuLockedClocks(self.handle, mhz, mhz)

    def reset_clock(self) -> None:
        self.nvml.nvmlDeviceResetGpuLockedClocks(self.handle)
        if self._locked:
            self._locked = False
            self._guard.released(self.uuid)

    def energy_j(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0  # mJ -> J

    def synchronize(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the current device: this rank's
