"""``energy_mode="auto"`` on 4 gloo ranks with simulated GPUs: measured saving against the plan.

Runs the auto-mode test's worker (tests/workers/energy_auto.py: MerakTrainer with
``energy_mode="auto"`` for 1F1B, zero-bubble and interleaved 1F1B, each followed by a run
without energy control whose losses must be equal; one torchrun launch) with longer simulated
instructions, more planned steps and no injected slow-down, and prints per schedule: the steps
spent profiling, at max clocks while the plan was computed, and planned; the plan's predicted
saving and the saving measured (median energy per step of the planned steps against the all-max
steps of the same run); their ratio (target >= 0.90); the step time change (target within
``energy_max_slowdown`` + 1%, i.e. +2%). The test asserts none of these wall-clock figures (run
this on an idle machine).

    python bench/energy_auto.py [--forward-s 0.1] [--after 10]
                                [--schedules 1f1b,zero_bubble,interleaved_1f1b]
"""

from __future__ import annotations

import argparse

from worker_launch import run_worker

MAX_SLOWDOWN = 0.01  # MerakArguments.energy_max_slowdown's default, which the worker keeps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-s", type=float, default=0.1,
                        help="simulated forward of one micro-batch at the highest clock")
    parser.add_argument("--after", type=int, default=10, help="planned steps measured")
    parser.add_argument("--schedules", default="1f1b,zero_bubble,interleaved_1f1b")
    args = parser.parse_args()
    report, failures, took = run_worker("energy_auto.py", "energy_auto_report.json", dict(
        MERAK_ENERGY_AUTO_FORWARD_S=str(args.forward_s), MERAK_ENERGY_AUTO_AFTER=str(args.after),
        MERAK_ENERGY_AUTO_DRIFT="0", MERAK_ENERGY_AUTO_SCHEDULES=args.schedules))
    print(f"4 ranks, forward {args.forward_s * 1e3:.0f} ms at the highest clock, "
          f"energy_max_slowdown {MAX_SLOWDOWN:.0%}; {took:.0f} s")
    print(f"{'schedule':18}{'profile':>8}{'all-max':>8}{'planned':>8}{'predicted':>10}"
          f"{'measured':>10}{'ratio':>7}{'time':>9}   targets: ratio >= 0.90, time <= "
          f"+{MAX_SLOWDOWN + 0.01:.0%}")
    for name, r in report.items():
        ratio = r["energy_saved"] / r["energy_predicted_saved"]
        time_ok = r["energy_step_time_change"] <= MAX_SLOWDOWN + 0.01
        verdict = "ok" if ratio >= 0.9 and time_ok else "MISSED"
        planned = r["steps"] - r["energy_plan_step"] + 1
        print(f"{name:18}{r['energy_profile_steps']:8d}{r['all_max_steps']:8d}{planned:8d}"
              f"{r['energy_predicted_saved']:10.2%}{r['energy_saved']:10.2%}{ratio:7.2f}"
              f"{r['energy_step_time_change']:+9.2%}   {verdict}")
    for name, error in failures.items():
        print(f"{name} failed its test assertions:\n{error.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
