"""Energy planner wall time and savings on the reference synthetic GPU (FINDINGS.md).

For (stages, micro-batches) in (4, 8), (8, 16), (8, 32): the all-max-clock iteration, the
default plan (minimum energy at no slowdown), the lowest-energy frontier point, and the physical
limit (every instruction at its own energy-optimal clock, ignoring time), with the planner's
wall time. The reference solver took 2 s on (4, 8) and 110 s on (8, 32).

    python bench/energy_planner.py [--sizes 4x8,8x16,8x32] [--unit-time 0.001] [--coarse 4]
                                   [--schedules 1f1b,zero_bubble,...|all]

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

from merak.energy.gpu import SyntheticGPUModel
from merak.energy.planner import EnergyPlanner
from merak.energy.profile_data import aggregate, synthetic_profile
from merak.schedule.registry import SCHEDULES, make_schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x8,8x16,8x32")
    parser.add_argument("--unit-time", type=float, default=None)
    parser.add_argument("--coarse", type=int, default=4, help="1: the whole frontier, fine")
    parser.add_argument("--window", type=int, default=6)
    parser.add_argument("--schedules", default="1f1b", help="comma-separated, or 'all'")
    args = parser.parse_args()
    model = SyntheticGPUModel()
    names = list(SCHEDULES) if args.schedules == "all" else args.schedules.split(",")
    print(f"{'schedule':24}{'pipeline':>9} {'all-max':>17} {'default plan':>22} "
          f"{'lowest energy':>22} {'physical limit':>15} {'planner':>9}")
    for name, size in ((n, s) for n in names for s in args.sizes.split(",")):
        stages, microbatches = map(int, size.split("x"))
        info = SCHEDULES[name]
        chunks = 2 if info.several_stages_per_rank else 1
        profiles, p2p = aggregate(synthetic_profile(model, stages, chunks=chunks))
        schedule = make_schedule(name, stages, microbatches, stages_per_rank=chunks,
                                 recompute=info.needs_recompute)
        planner = EnergyPlanner(schedule, profiles, p2p, unit_time=args.unit_time)
        start = time.perf_counter()
        base_time, base_energy = planner.evaluate(planner.max_clock_plan())
        points = planner.frontier(coarse=args.coarse, window=args.window)
        chosen = planner.choose(points, base_time)
        took = time.perf_counter() - start
        lowest = min(points, key=lambda p: p.energy_j)
        _, limit = planner.physical_limit()
        saved = lambda e, b=base_energy: 1 - e / b
        print(f"{name:24}{stages:>3}x{microbatches:<5} {base_time:7.4f}s {base_energy:7.1f}J "
              f"{chosen.time_s / base_time - 1:+7.2%} {saved(chosen.energy_j):6.2%} saved "
              f"{lowest.time_s / base_time - 1:+7.2%} {saved(lowest.energy_j):6.2%} saved "
              f"{saved(limit):8.2%} saved {took:8.1f}s")


if __name__ == "__main__":
    main()
