"""Energy figures a person looks at: the time / energy frontier of a plan (`merak energy plan`
writes it beside the plan, as ``plan.png``) and a run's energy and time per step
(``energy_steps.png`` beside ``energy_steps.csv``: profiling, all-max and planned steps, the
steps where a plan was deployed, and the saving)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

PHASE_COLORS = {"profile": "tab:gray", "all-max": "tab:blue", "plan": "tab:green"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_frontier_png(points, chosen, baseline: tuple[float, float], path: str | Path,
                      limit_s: float | None = None) -> Path:
    """The frontier's points (time, energy per iteration), the all-max-clock plan, the time
    allowed (`limit_s`) and the chosen plan with its saving."""
    plt = _pyplot()
    base_time, base_energy = baseline
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([p.time_s for p in points], [p.energy_j for p in points], ".", ms=3,
            color="tab:blue", label=f"frontier ({len(points)} plans)")
    lowest = min(points, key=lambda p: p.energy_j)
    ax.plot(lowest.time_s, lowest.energy_j, "v", color="tab:purple",
            label=f"lowest energy ({1 - lowest.energy_j / base_energy:.1%} saved, "
                  f"{lowest.time_s / base_time - 1:+.1%} time)")
    ax.plot(base_time, base_energy, "s", color="gray", label="all max clocks")
    if limit_s is not None:
        ax.axvline(limit_s, ls="--", lw=1, color="tab:red",
                   label=f"time allowed ({limit_s / base_time - 1:+.1%})")
    ax.plot(chosen.time_s, chosen.energy_j, "*", color="tab:red", ms=14,
            label=f"chosen ({1 - chosen.energy_j / base_energy:.2%} saved, "
                  f"{chosen.time_s / base_time - 1:+.2%} time)")
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("energy per iteration, every GPU (J)")
    ax.set_title("time / energy frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def save_steps_png(steps: Sequence[tuple[int, float, float, str]], path: str | Path,
                   events: Sequence[tuple[int, str]] = (), title: str = "") -> Path:
    """Energy (every GPU) and time (the slowest rank) of each step, ``(step, time_s, energy_j,
    phase)``, coloured by phase, with the median of each phase's steps and a line at each
    ``(step, label)`` of `events` (a plan deployed, a re-plan)."""
    plt = _pyplot()
    fig, (energy_ax, time_ax) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for phase in dict.fromkeys(p for *_, p in steps):
        mine = [s for s in steps if s[3] == phase]
        color = PHASE_COLORS.get(phase, "black")
        for ax, column in ((energy_ax, 2), (time_ax, 1)):
            values = [s[column] for s in mine]
            ax.plot([s[0] for s in mine], values, ".", color=color, ms=5,
                    label=f"{phase} (median {statistics.median(values):.4g})")
    for step, label in events:
        for ax in (energy_ax, time_ax):
            ax.axvline(step - 0.5, ls="--", lw=1, color="tab:red")
        energy_ax.annotate(label, (step - 0.5, 1), xycoords=("data", "axes fraction"),
                           fontsize=7, rotation=90, va="top", ha="right", color="tab:red")
    energy_ax.set_ylabel("energy per step (J)")
    time_ax.set_ylabel("step time (s)")
    time_ax.set_xlabel("step")
    for ax in (energy_ax, time_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    energy_ax.set_title(title or "energy and time per step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
