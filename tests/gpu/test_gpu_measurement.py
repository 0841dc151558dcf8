"""On one GPU: the CUDA-event timer against torch.profiler, the activation meter against the
CUDA allocator, and read-only NVML checks (UUID mapping, clocks, energy counter refresh)."""

from __future__ import annotations

import time

import pytest
import torch

from merak.recompute.meter import ActivationMeter
from merak.runtime.device_timer import DeviceTimer


def test_device_timer_matches_the_profilers_kernel_time():
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    timer = DeviceTimer(device)
    timer.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timer.begin("matmuls")
        for _ in range(20):
            a = (a @ a).tanh_()
        timer.end("matmuls")
        host_after_launch = time.perf_counter()
        (_, start, end), = timer.intervals()
        host_done = time.perf_counter()
    kernels = sum(e.device_time for e in prof.events()  # the kernels themselves, us -> s
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    measured = end - start
    assert measured == pytest.approx(kernels, rel=0.15), (measured, kernels)
    # the timer read the events after the work ended (the host had run ahead of it)
    assert host_done - host_after_launch > 0.5 * measured


def test_activation_meter_matches_the_cuda_allocator():
    device = torch.device("cuda")
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 4096),
                                                      torch.nn.GELU(),
                                                      torch.nn.Linear(4096, 1024))
                                  for _ in range(4)]).to(device)
    x = torch.randn(64, 128, 1024, device=device)
    meter = ActivationMeter(list(model.parameters()))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with meter.recording():
        loss = model(x).square().mean()
    # what the graph keeps: the allocations since (+ the scalar loss), and the input x, which
    # the first layer saves but was allocated before
    held = torch.cuda.memory_allocated() - before + x.numel() * x.element_size()
    assert meter.peak == pytest.approx(held, rel=0.05), (meter.peak, held)
    loss.backward()


@pytest.fixture()
def nvml():
    pynvml = pytest.importorskip("pynvml", reason="pip install nvidia-ml-py")
    pynvml.nvmlInit()
    yield pynvml
    pynvml.nvmlShutdown()


def test_nvml_finds_torchs_gpu_by_uuid(nvml):
    from merak.energy.gpu import NVMLGPU, nvml_uuid

    uuid = nvml_uuid(torch.cuda.current_device())
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    name = nvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else name
    assert name in torch.cuda.get_device_name() or torch.cuda.get_device_name() in name
    gpu = NVMLGPU(uuid, control=False)  # read-only: no clock is locked
    clocks = gpu.supported_clocks()
    assert clocks == sorted(clocks, reverse=True) and len(clocks) > 1, clocks


def test_nvml_energy_counter_refreshes_within_100_ms(nvml):
    from merak.energy.gpu import NVMLGPU, nvml_uuid

    gpu = NVMLGPU(nvml_uuid(torch.cuda.current_device()), control=False)
    a = torch.randn(8192, 8192, device="cuda")
    changes, last, start = [], gpu.energy_j(), time.perf_counter()
    while time.perf_counter() - start < 2.0:
        a = (a @ a).tanh_()  # keep the GPU drawing power
        value = gpu.energy_j()
        if value != last:
            changes.append(time.perf_counter())
            last = value
    torch.cuda.synchronize()
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    assert len(gaps) >= 5, f"the energy counter changed {len(changes)} times in 2 s"
    assert max(sorted(gaps)[:len(gaps) // 2 + 1]) < 0.1, gaps  # median refresh under 100 ms
