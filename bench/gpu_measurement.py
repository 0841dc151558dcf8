"""On one CUDA GPU: how well Merak's measurements read the clocks (figures, not tests; the
project keeps clock-derived targets out of the test suite, where a busy machine would fail them).

    .venv/bin/python bench/gpu_measurement.py [--out bench/results/gpu_measurement.json]

Prints, with its targets:
- the CUDA-event timer (`DeviceTimer`) against torch.profiler's kernel time for 20 matmuls:
  their ratio (target within 15%), and how long the host waited for the events once the work
  was queued, as a fraction of the measured time (the events are read after the work, not at
  launch: target > 0.5);
- NVML's energy counter while the GPU is busy: how often it changed in 2 s and the median
  interval between changes (target < 100 ms, which the energy profiler's step windows assume).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _common import RESULTS


def timer_against_profiler(size: int = 4096, repeats: int = 20) -> dict:
    from merak.runtime.device_timer import DeviceTimer

    device = torch.device("cuda")
    a = torch.randn(size, size, device=device)
    # warm-up: the first matmul creates cuBLAS's handle and workspace and loads its kernels;
    # timed, the GPU would idle inside the interval while the host does that (3.2x the
    # kernels' time on the first H200 run)
    for _ in range(3):
        a = (a @ a).tanh_()
    torch.cuda.synchronize()
    timer = DeviceTimer(device)
    timer.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timer.begin("matmuls")
        for _ in range(repeats):
            a = (a @ a).tanh_()
        timer.end("matmuls")
        queued = time.perf_counter()
        (_, start, end), = timer.intervals()
        read = time.perf_counter()
    kernels = sum(e.device_time for e in prof.events()  # the kernels themselves, us -> s
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    measured = end - start
    return {"timer_s": measured, "profiler_kernels_s": kernels,
            "timer_over_profiler": measured / kernels,
            "host_wait_fraction": (read - queued) / measured}


def nvml_refresh(seconds: float = 2.0) -> dict:
    from merak.energy.profiling.gpu import NVMLGPU, nvml_uuid

    gpu = NVMLGPU(nvml_uuid(torch.cuda.current_device()), control=False)
    a = torch.randn(8192, 8192, device="cuda")
    changes, last, start = [], gpu.energy_j(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        a = (a @ a).tanh_()  # keep the GPU drawing power
        value = gpu.energy_j()
        if value != last:
            changes.append(time.perf_counter())
            last = value
    torch.cuda.synchronize()
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    return {"energy_changes": len(changes),
            "median_refresh_s": statistics.median(gaps) if gaps else float("inf")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "gpu_measurement.json"))
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device: torch {torch.__version__} sees no GPU")
    figures = {"device": torch.cuda.get_device_name(), **timer_against_profiler()}
    print(f"{figures['device']}: CUDA-event timer {figures['timer_s'] * 1e3:.2f} ms, profiler "
          f"kernels {figures['profiler_kernels_s'] * 1e3:.2f} ms, ratio "
          f"{figures['timer_over_profiler']:.3f} (target within 0.85-1.15); the host waited "
          f"{figures['host_wait_fraction']:.2f} of it for the events (target > 0.5)")
    try:
        figures.update(nvml_refresh())
        print(f"NVML energy counter: {figures['energy_changes']} changes in 2 s, median "
              f"interval {figures['median_refresh_s'] * 1e3:.0f} ms (target < 100 ms)")
    except ImportError:
        print("NVML: not measured (pip install nvidia-ml-py)")
    Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cli.out).write_text(json.dumps(figures, indent=2))
    print(f"wrote {cli.out}")


if __name__ == "__main__":
    main()
