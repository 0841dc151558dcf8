"""On one GPU: the CUDA-event timer's intervals, the activation meter against the CUDA
allocator, and read-only NVML checks (UUID mapping, clocks, the energy counter). Figures read
from clocks (timer against torch.profiler, NVML's refresh interval) are in
bench/gpu_measurement.py."""

from __future__ import annotations

import time

import pytest
import torch

from merak.recompute.meter import ActivationMeter
from merak.runtime.device_timer import DeviceTimer


def test_device_timer_reads_one_ordered_interval_per_region():
    """How close the events come to the profiler's kernel time is a figure
    (bench/gpu_measurement.py); here only what the timer returns."""
    device = torch.device("cuda")
    a = torch.randn(1024, 1024, device=device)
    timer = DeviceTimer(device)
    timer.reset()
    for name in ("first", "second"):
        timer.begin(name)
        for _ in range(4):
            a = (a @ a).tanh_()
        timer.end(name)
    intervals = timer.intervals()
    assert [name for name, _, _ in intervals] == ["first", "second"]
    (_, s1, e1), (_, s2, e2) = intervals
    assert s1 < e1 <= s2 < e2, intervals


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
    from merak.energy.profiling.gpu import NVMLGPU, nvml_uuid

    uuid = nvml_uuid(torch.cuda.current_device())
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    name = nvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else name
    assert name in torch.cuda.get_device_name() or torch.cuda.get_device_name() in name
    gpu = NVMLGPU(uuid, control=False)  # read-only: no clock is locked
    clocks = gpu.supported_clocks()
    assert clocks == sorted(clocks, reverse=True) and len(clocks) > 1, clocks


def test_nvml_energy_counter_rises_under_load(nvml):
    """Its refresh interval is a figure (bench/gpu_measurement.py)."""
    from merak.energy.profiling.gpu import NVMLGPU, nvml_uuid

    gpu = NVMLGPU(nvml_uuid(torch.cuda.current_device()), control=False)
    a = torch.randn(8192, 8192, device="cuda")
    readings, start = [gpu.energy_j()], time.perf_counter()
    while time.perf_counter() - start < 1.0:
        a = (a @ a).tanh_()  # keep the GPU drawing power
        readings.append(gpu.energy_j())
    torch.cuda.synchronize()
    assert readings == sorted(readings) and readings[-1] > readings[0], readings[:: 10]
