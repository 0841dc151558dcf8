"""What the energy hooks do at each instruction boundary, on a GPU that records its calls
(defects a CPU run cannot show by timing). The profiler synchronises the device, then reads
the clock and the energy counter, then sets the next clock; a clock plan synchronises before
each clock change; measuring without a plan (the baseline) sets no clock and waits only at the
ends of a step; NVML synchronises only when asked. The GPU backends themselves: the simulated
GPU's times and energy, NVML through a mocked library."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from merak.energy.planning.plan_file import ClockPlanError
from merak.energy.profiling import profiler
from merak.energy.profiling.gpu import NVMLGPU, GPUControl, SimulatedGPU, SyntheticGPUModel
from merak.energy.profiling.profiler import ClockProfiler
from merak.energy.training import deploy
from merak.energy.training.deploy import ClockPlanHook
from merak.schedule.actions import Action, ActionKind

K = ActionKind
# one step of pipeline rank 0 of 2 (1F1B, two micro-batches), as the interpreter calls hooks
STEP = [Action(K.FORWARD, 0, 0), Action(K.SEND_ACT, 0, 0, peer=1, peer_stage=1, group=0),
        Action(K.FORWARD, 0, 1), Action(K.SEND_ACT, 0, 1, peer=1, peer_stage=1, group=1),
        Action(K.RECV_GRAD, 0, 0, peer=1, peer_stage=1, group=1), Action(K.BACKWARD, 0, 0),
        Action(K.RECV_GRAD, 0, 1, peer=1, peer_stage=1, group=2), Action(K.BACKWARD, 0, 1),
        Action(K.OPTIMIZER_STEP)]


class RecordingGPU(GPUControl):
    """Every call in order: ``sync``, ``read`` (energy), ``set``/``reset``, ``begin``/``end``
    (the instruction brackets); the host clock's reads are recorded as ``clock``."""

    def __init__(self):
        self.calls: list[tuple] = []

    def supported_clocks(self) -> list[int]:
        return [1410, 1050, 900]

    def set_clock(self, mhz: int) -> None:
        self.calls.append(("set", mhz))

    def reset_clock(self) -> None:
        self.calls.append(("reset",))

    def energy_j(self) -> float:
        self.calls.append(("read",))
        return float(len(self.calls))

    def synchronize(self) -> None:
        self.calls.append(("sync",))

    def instruction_begin(self, name: str, pp_rank: int) -> None:
        self.calls.append(("begin", name))

    def instruction_end(self, name: str, pp_rank: int) -> None:
        self.calls.append(("end", name))


@pytest.fixture()
def gpu(monkeypatch) -> RecordingGPU:
    gpu = RecordingGPU()

    def perf_counter() -> float:
        gpu.calls.append(("clock",))
        return float(len(gpu.calls))

    for module in (profiler, deploy):  # both read the host clock as time.perf_counter()
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=perf_counter))
    return gpu


def _run_step(hook, step: int = 0) -> None:
    hook.on_step_begin(step)
    for action in STEP:
        hook.on_instruction_begin(action.name, action)
        hook.on_instruction_end(action.name, action)
    hook.on_step_end(step)


def test_profiler_synchronises_then_reads_then_sets_the_clock(gpu):
    """Reading before the device is idle put in-flight work (a send, the previous kernels) in
    the next instruction's window; the clock is set only once what ran before has finished."""
    hook = ClockProfiler(gpu, pp_rank=0)
    hook.clock = 1050
    _run_step(hook)
    expected = []
    for action in STEP:
        if action.kind in (K.FORWARD, K.BACKWARD):
            expected += [("sync",), ("clock",), ("read",), ("set", 1050), ("begin", action.name),
                         ("end", action.name), ("sync",), ("clock",), ("read",)]
    assert gpu.calls == expected
    assert sorted(hook.samples) == [("backward", 1050), ("forward", 1050)]
    assert hook.blocked[0] > 0  # the windows between compute instructions: p2p


def test_plan_hook_synchronises_before_each_clock_change(gpu):
    plan = [("forward", 1050), ("forward", 900), ("backward", 1410), ("backward", 1050)]
    hook = ClockPlanHook(gpu, plan, pp_rank=0)
    _run_step(hook)
    expected = [("sync",), ("clock",), ("read",)]  # the step's window opens on an idle device
    for name, mhz in plan:
        expected += [("sync",), ("set", mhz), ("begin", name), ("end", name)]
    expected += [("sync",), ("clock",), ("read",)]
    assert gpu.calls == expected
    assert hook.consumed == [len(plan)] and len(hook.steps) == 1


def test_measurement_only_changes_no_clock_and_waits_only_per_step(gpu):
    """The baseline is the unmodified run: no clock set, no synchronisation between
    instructions; time and energy are read once at each end of the step."""
    hook = ClockPlanHook(gpu, None, pp_rank=0)
    for step in range(2):
        _run_step(hook, step)
    assert not [c for c in gpu.calls if c[0] in ("set", "reset")], gpu.calls
    compute = [a.name for a in STEP if a.kind in (K.FORWARD, K.BACKWARD)]
    one_step = [("sync",), ("clock",), ("read",),
                *[c for name in compute for c in (("begin", name), ("end", name))],
                ("sync",), ("clock",), ("read",)]
    assert gpu.calls == one_step * 2
    assert hook.consumed == [len(compute)] * 2 and len(hook.steps) == 2


def test_measurement_only_runs_at_the_clock_the_gpu_has():
    """On the simulated GPU: instructions still take their simulated time, at whatever clock
    the GPU was left at (here a lowered one), as a real GPU runs at its own."""
    model = SyntheticGPUModel(forward_s=0.0, clock_step=90)
    gpu = SimulatedGPU(model, num_ranks=2, sleep=lambda s: None)
    gpu.set_clock(1050)
    _run_step(ClockPlanHook(gpu, None, pp_rank=0))
    assert set(gpu.ran) == {("forward", 1050), ("backward", 1050)} and gpu.clock_mhz == 1050


def test_nvml_synchronises_only_when_asked(monkeypatch):
    """The instruction brackets of a real GPU wait for nothing (the hooks order the waits);
    `synchronize` waits for the device."""
    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    nvml = SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetSupportedMemoryClocks=lambda h: [1215],
        nvmlDeviceGetSupportedGraphicsClocks=lambda h, mem: [1410, 900])
    gpu = NVMLGPU("GPU-1", nvml=nvml, control=False)
    gpu.instruction_begin("forward", 0)
    gpu.instruction_end("forward", 0)
    assert synced == []
    gpu.synchronize()
    assert synced == [None]


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_simulated_gpu_times_and_charges_the_model():
    clock = _FakeClock()
    model = SyntheticGPUModel(switch_latency_s=0.01)
    gpu = SimulatedGPU(model, num_ranks=2, clock=clock, sleep=clock.sleep)
    hook = ClockPlanHook(gpu, [("forward", 1050), ("backward", 1410)], pp_rank=0)
    hook.on_step_begin(0)
    clock.now += 0.5  # blocked on p2p
    for name, mb in (("forward", 0), ("backward", 0)):
        action = Action(ActionKind(name), 0, mb)
        hook.on_instruction_begin(name, action)
        clock.now += 0.001  # the real CPU work, shorter than the model's
        hook.on_instruction_end(name, action)
    hook.on_step_end(0)
    fwd, bwd = model.time("forward", 0, 2, 1050), model.time("backward", 0, 2, 1410)
    expected = (0.51 * 75 + fwd * model.power(1050) + 0.01 * 75 + bwd * model.power(1410))
    assert hook.steps[0].time_s > 0 and gpu.energy_j() == pytest.approx(expected)
    assert clock.now == pytest.approx(0.5 + 0.01 + fwd + 0.01 + bwd)
    hook.on_step_begin(1)
    with pytest.raises(ClockPlanError, match="instruction 0 of the step is backward"):
        hook.on_instruction_begin("backward", Action(ActionKind.BACKWARD, 0, 0))
    with pytest.raises(ValueError, match="1234 MHz is not a supported clock"):
        gpu.set_clock(1234)


def test_simulated_gpu_times_every_instruction_kind_and_chunk():
    model = SyntheticGPUModel()
    forward = model.reference_time("forward", 0, 4)
    assert forward == pytest.approx(0.04)
    assert model.reference_time("recompute", 0, 4) == forward
    assert model.reference_time("backward", 0, 4) == pytest.approx(2 * forward)
    for half in ("backward_input", "backward_weight"):
        assert model.reference_time(half, 0, 4) == pytest.approx(forward)
    assert model.reference_time("forward", 3, 4) == pytest.approx(1.15 * forward)  # the head
    assert model.reference_time("backward", 1, 4, chunks=2) == pytest.approx(forward)
    with pytest.raises(ValueError, match="compute instructions only, not 'send_act'"):
        model.reference_time("send_act", 0, 4)
    clock = _FakeClock()
    gpu = SimulatedGPU(model, num_ranks=4, chunks=2, clock=clock, sleep=clock.sleep)
    gpu.set_clock(1050)
    gpu.instruction_begin("backward_weight", 3)
    gpu.instruction_end("backward_weight", 3)
    assert clock.now == pytest.approx(model.time("backward_weight", 3, 4, 1050, chunks=2))
    assert clock.now == pytest.approx(0.04 * 1.15 / 2 * model.slowdown(1050))


def test_nvml_backend_with_a_mocked_nvml():
    """The GPU is found by UUID (NVML's order is not CUDA's), locking is probed at start (a
    clear PermissionError without the right), and the first locked clock is announced to the
    guard (which resets at exit, on SIGTERM / SIGABRT and from its watchdog process:
    tests/test_clock_watchdog.py), the reset too."""
    calls, told = [], []
    guard = SimpleNamespace(locking=lambda device, reset: told.append(("locking", device, reset)),
                            released=lambda device: told.append(("released", device)))

    def nvml(allowed=True):
        def lock(h, lo, hi):
            if not allowed:
                raise RuntimeError("NVML_ERROR_NO_PERMISSION")
            calls.append(("lock", h, lo, hi))
        return SimpleNamespace(
            nvmlInit=lambda: calls.append("init"),
            nvmlDeviceGetHandleByUUID=lambda u: f"handle-{u}",
            nvmlDeviceGetSupportedMemoryClocks=lambda h: [1215, 877],
            nvmlDeviceGetSupportedGraphicsClocks=lambda h, mem: [900, 1410, 1395] if mem == 1215
            else [],
            nvmlDeviceSetGpuLockedClocks=lock,
            nvmlDeviceResetGpuLockedClocks=lambda h: calls.append(("reset", h)),
            nvmlDeviceGetTotalEnergyConsumption=lambda h: 123456)

    gpu = NVMLGPU("GPU-1234", nvml=nvml(), guard=guard)
    assert gpu.supported_clocks() == [1410, 1395, 900]
    h = "handle-GPU-1234"
    assert calls == ["init", ("lock", h, 1410, 1410), ("reset", h)] and not told  # the probe
    gpu.set_clock(1395)
    gpu.set_clock(900)
    gpu.reset_clock()
    assert calls[3:] == [("lock", h, 1395, 1395), ("lock", h, 900, 900), ("reset", h)]
    assert told == [("locking", "GPU-1234", gpu.reset_clock), ("released", "GPU-1234")]  # once
    assert gpu.energy_j() == pytest.approx(123.456)
    with pytest.raises(ValueError, match="not a supported clock"):
        gpu.set_clock(1000)
    with pytest.raises(PermissionError, match="nvidia-smi -acp UNRESTRICTED"):
        NVMLGPU("GPU-1234", nvml=nvml(allowed=False))
    assert NVMLGPU("GPU-1234", nvml=nvml(allowed=False), control=False).energy_j() > 0
