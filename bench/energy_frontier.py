"""The clock frontier (`merak energy plan`): wall time and savings on the reference synthetic GPU
(`merak.energy.profiling.gpu.SyntheticGPUModel`).

For (stages, micro-batches) in (4, 8), (8, 16), (8, 32): the all-max-clock iteration, the
default plan (minimum energy at no slowdown), the plan at 1% slowdown (MerakTrainer's
`energy_max_slowdown` default), the lowest-energy frontier point, and the physical limit (every
instruction at its own energy-optimal clock, ignoring time), with the planner's wall time.

For the sizes in ``--lowtime`` (default 8x32) lowtime's own solver then plans the same DAG the
reference way (its `PhillipsDessouky.run` walking the whole frontier at one time unit, as Perseus
does) in the same run, and the two are printed side by side: wall times, their ratio (target:
the planner 5x faster; 8x32 in at most 22 s on a quiet 2-core machine, where lowtime's took 110
s) and the energy saved at no slowdown and at 1% (target: never less than lowtime's).

A GPU model that is none of the project's presets (`HELD_OUT`: an H100-like range of clocks,
less compute-bound, more dynamic power) is planned too (4x8 1F1B): the energy saved at +0.5%
time (target: at least 15%).

    python bench/energy_frontier.py [--sizes 4x8,8x16,8x32] [--unit-time 0.001] [--coarse 4]
                                    [--schedules 1f1b,zero_bubble,...|all] [--lowtime 8x32|none]

Other schedules plan over their own instructions (recompute for Merak's schedules, which get
activation recomputation; backward_input / backward_weight for zero_bubble; 2 model chunks per
rank for interleaved_1f1b, each chunk's instructions 1/2 of the rank's).

Coarse to fine (`--coarse 4 --window 6`, the default) walks the frontier at 4 time units per
step, then at one unit within 6 clocks of the coarse default plan; `--coarse 1` walks it all at
one unit (the reference solver's way).
"""

from __future__ import annotations

import argparse
import time

from merak.energy.planning.frontier import ClockFrontier
from merak.energy.profiling.gpu import SyntheticGPUModel
from merak.energy.profiling.profile_data import aggregate, synthetic_profile
from merak.schedule.registry import SCHEDULES, make_schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x8,8x16,8x32")
    parser.add_argument("--unit-time", type=float, default=None)
    parser.add_argument("--coarse", type=int, default=4, help="1: the whole frontier, fine")
    parser.add_argument("--window", type=int, default=6)
    parser.add_argument("--schedules", default="1f1b", help="comma-separated, or 'all'")
    parser.add_argument("--lowtime", default="8x32",
                        help="sizes to plan with lowtime's own solver too, or 'none'")
    args = parser.parse_args()
    names = list(SCHEDULES) if args.schedules == "all" else args.schedules.split(",")
    print(f"{'schedule':24}{'pipeline':>9} {'all-max':>17} {'default plan':>22} "
          f"{'at 1% slowdown':>22} {'lowest energy':>22} {'physical limit':>15} {'planner':>9}")
    against = []
    for name, size in ((n, s) for n in names for s in args.sizes.split(",")):
        planner = _planner(name, size, args.unit_time)
        took, points = _timed(lambda p=planner: p.frontier(coarse=args.coarse,
                                                           window=args.window))
        base_time, base_energy = planner.evaluate(planner.max_clock_plan())
        chosen, slower = _chosen(planner, points)
        lowest = min(points, key=lambda p: p.energy_j)
        _, limit = planner.physical_limit()
        saved = lambda e, b=base_energy: 1 - e / b
        print(f"{name:24}{size:>9} {base_time:7.4f}s {base_energy:7.1f}J "
              f"{chosen.time_s / base_time - 1:+7.2%} {saved(chosen.energy_j):6.2%} saved "
              f"{slower.time_s / base_time - 1:+7.2%} {saved(slower.energy_j):6.2%} saved "
              f"{lowest.time_s / base_time - 1:+7.2%} {saved(lowest.energy_j):6.2%} saved "
              f"{saved(limit):8.2%} saved {took:8.1f}s", flush=True)
        if size in args.lowtime.split(","):
            against.append((name, size, took, saved(chosen.energy_j), saved(slower.energy_j)))
    held_out = _planner("1f1b", "4x8", args.unit_time, HELD_OUT)
    base_time, base_energy = held_out.evaluate(held_out.max_clock_plan())
    limit = held_out.time_limit(base_time, max_slowdown=0.005)
    point = held_out.choose(held_out.frontier(focus_time=limit, coarse=args.coarse,
                                              window=args.window), base_time,
                            max_slowdown=0.005)
    print(f"held-out GPU model, 1f1b 4x8: {1 - point.energy_j / base_energy:.2%} energy saved "
          f"at {point.time_s / base_time - 1:+.2%} time (allowed +0.50%; target >= 15%)")
    for name, size, took, default, slower in against:
        reference = _planner(name, size, args.unit_time)
        reference.fast = False  # lowtime's PhillipsDessouky.run, the whole frontier, 1 unit
        lowtime_s, points = _timed(lambda r=reference: r.frontier(coarse=1))
        base_time, base_energy = reference.evaluate(reference.max_clock_plan())
        theirs = [1 - p.energy_j / base_energy for p in _chosen(reference, points)]
        print(f"{name} {size}: planner {took:.1f} s, lowtime {lowtime_s:.1f} s: "
              f"{lowtime_s / took:.1f}x faster; energy saved at +0% {default:.3%} (lowtime "
              f"{theirs[0]:.3%}), at +1% {slower:.3%} (lowtime {theirs[1]:.3%})", flush=True)


HELD_OUT = SyntheticGPUModel(max_clock=1980, min_clock=1005, clock_step=15, compute_share=0.8,
                             static_w=120.0, dynamic_w=280.0, forward_s=0.03,
                             backward_ratio=1.8)


def _planner(name: str, size: str, unit_time: float | None,
             model: SyntheticGPUModel | None = None) -> ClockFrontier:
    stages, microbatches = map(int, size.split("x"))
    info = SCHEDULES[name]
    chunks = 2 if info.several_stages_per_rank else 1
    profiles, p2p = aggregate(synthetic_profile(model or SyntheticGPUModel(), stages,
                                                chunks=chunks))
    schedule = make_schedule(name, stages, microbatches, stages_per_rank=chunks,
                             recompute=info.needs_recompute)
    return ClockFrontier(schedule, profiles, p2p, unit_time=unit_time)


def _timed(run):
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def _chosen(planner: ClockFrontier, points) -> tuple:
    """The plans at no slowdown and at 1%."""
    base_time = planner.evaluate(planner.max_clock_plan())[0]
    return planner.choose(points, base_time), planner.choose(points, base_time, max_slowdown=0.01)


if __name__ == "__main__":
    main()
