"""Fault sweep: one rank of a small MerakTrainer job stopped (SIGSTOP) or killed (SIGKILL) at a
random point (forward, backward, the step tail's dp all-reduce or optimizer step, evaluation,
a save) of a random step, at pp=2 and dp2 x pp2; for each run, how long after the fault every
other rank exited and whether its error named the missing rank.

    .venv/bin/python bench/fault_sweep.py --headline          # ddp_timeout=20, 4 ranks, a stop
    .venv/bin/python bench/fault_sweep.py --runs 12 --timeout 10

The headline: ddp_timeout=20, one of 4 ranks stopped mid-step; every other rank must exit
within 40 s naming it. tests/test_faults.py runs four fixed scenarios of the same harness
(bench/fault_harness.py, the job bench/fault_worker.py).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from fault_harness import launch
from fault_worker import POINTS

LAYOUTS = ((2, 2), (4, 2))  # (world, pp): pp=2 and dp2 x pp2


def run(world: int, pp: int, fault: str, timeout_s: int) -> dict:
    missing = int(fault.split(":")[0])
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        outcome = launch(Path(tmp), world, pp, fault, timeout_s)
        took = time.perf_counter() - start
    survivors = [r for r in range(world) if r != missing]
    exits = {r: outcome.exit_after_s.get(r) for r in survivors}
    named = {r: outcome.named(r, missing) for r in survivors}
    slowest = max((s for s in exits.values() if s is not None), default=None)
    ok = outcome.fault is not None and all(s is not None for s in exits.values()) \
        and all(named.values())
    times = ", ".join(f"{r}: {s:.1f} s" if s is not None else f"{r}: -" for r, s in exits.items())
    print(f"{'ok  ' if ok else 'FAIL'} world {world} pp {pp} fault {fault:24s} survivors "
          f"exited after {times}; named rank {missing}: {all(named.values())} (launch "
          f"{took:.0f} s)", flush=True)
    if not ok:
        print(outcome.summary(), flush=True)
    return {"ok": ok, "slowest": slowest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=20, help="ddp_timeout, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--headline", action="store_true",
                        help="4 ranks, a random rank stopped in a random training action")
    args = parser.parse_args()
    draw = random.Random(args.seed)
    if args.headline:
        plans = [(4, 2, f"{draw.randrange(4)}:{draw.choice(POINTS[:4])}:3:stop")]
    else:
        plans = []
        for _ in range(args.runs):
            world, pp = draw.choice(LAYOUTS)
            point = draw.choice(POINTS)
            step = draw.randint(2, 4) if point not in ("evaluation", "save") else 3
            plans.append((world, pp, f"{draw.randrange(world)}:{point}:{step}:"
                                     f"{draw.choice(('stop', 'kill'))}"))
    results = [run(world, pp, fault, args.timeout) for world, pp, fault in plans]
    slowest = max((r["slowest"] for r in results if r["slowest"] is not None), default=None)
    print(f"{sum(r['ok'] for r in results)}/{len(results)} runs: every survivor exited naming "
          f"the missing rank; slowest exit {slowest:.1f} s after the fault with ddp_timeout="
          f"{args.timeout}" if slowest is not None else "no run completed")


if __name__ == "__main__":
    main()
