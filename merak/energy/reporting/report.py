"""`merak energy report`: a run's measured steps (``energy_steps.csv``, written by MerakTrainer
with `energy_gpu` set) against the all-max-clock baseline: a measured baseline run, or the
baseline a plan file predicted."""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunSummary:
    name: str
    steps: int
    time_s: float    # median iteration time
    energy_j: float  # median energy per iteration, every GPU


def summarize(path: str | Path, skip: int = 1) -> RunSummary:
    """Medians over the steps of an ``energy_steps.csv``, after the first `skip` (warm-up)."""
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "time_s" not in rows[0] or "energy_j" not in rows[0]:
        raise ValueError(f"{path} is not an energy_steps.csv (columns step, time_s, energy_j): "
                         f"train with energy_gpu set to write one")
    kept = rows[skip:] if len(rows) > skip else rows
    return RunSummary(str(path), len(kept), statistics.median(float(r["time_s"]) for r in kept),
                      statistics.median(float(r["energy_j"]) for r in kept))


def report(run: RunSummary, baseline: RunSummary | None, plan: dict | None) -> list[str]:
    """The report's lines."""
    if baseline is None and (plan is None or "baseline" not in plan):
        raise ValueError("nothing to compare with: give --baseline (an all-max-clock run's "
                         "energy_steps.csv) or --plan (a plan file with its predicted baseline)")
    lines = [f"{'':22}{'time/step (s)':>15}{'energy/step (J)':>17}",
             f"{'this run':22}{run.time_s:15.4f}{run.energy_j:17.1f}   ({run.steps} steps)"]
    base = (baseline.time_s, baseline.energy_j) if baseline is not None else \
        (plan["baseline"]["time_s"], plan["baseline"]["energy_j"])
    what = "all-max (measured)" if baseline is not None else "all-max (predicted)"
    lines.append(f"{what:22}{base[0]:15.4f}{base[1]:17.1f}")
    if plan is not None:
        predicted = plan["predicted"]
        lines.append(f"{'plan (predicted)':22}{predicted['time_s']:15.4f}"
                     f"{predicted['energy_j']:17.1f}")
        lines.append(f"measured vs predicted: time {run.time_s / predicted['time_s'] - 1:+.2%}, "
                     f"energy {run.energy_j / predicted['energy_j'] - 1:+.2%}")
    lines.append(f"against all-max clocks: {1 - run.energy_j / base[1]:.2%} energy saved, "
                 f"{run.time_s / base[0] - 1:+.2%} time")
    return lines
