"""The plan file: ``{"predicted": {...}, "baseline": {...}, "schedules": [...]}``.

``schedules`` holds one Zeus-style FrequencySchedule per rank,
``{"rank": r, "frequencies": [["forward", 1410], ["backward", 1215], ...]}``: the compute
instructions of the rank's pipeline program in program order (`expected_instructions`; with
several model chunks per rank, every chunk's). `check_clock_plan` rejects a plan that does not
fit the job before training starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from merak.schedule.actions import Schedule


class ClockPlanError(ValueError):
    """A frequency plan that does not fit this job."""


def save_clock_plan(path: str | Path, schedules: list[dict], predicted: dict,
                    baseline: dict | None = None, meta: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"predicted": predicted, "schedules": schedules}
    if baseline is not None:
        body["baseline"] = baseline
    if meta:
        body["meta"] = meta
    path.write_text(json.dumps(body, indent=1))
    return path


def load_clock_plan(path: str | Path) -> dict:
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ClockPlanError(f"cannot read the energy plan {path}: {error}") from None
    if not isinstance(body, dict) or not isinstance(body.get("schedules"), list):
        raise ClockPlanError(f"{path} is not an energy plan: it needs a 'schedules' list "
                             f"(write one with `merak energy plan`)")
    return body


def expected_instructions(schedule: Schedule, pp_rank: int) -> list[str]:
    """The compute instructions pipeline rank `pp_rank` runs per step, in program order."""
    return [a.name for a in schedule.compute_actions(pp_rank)]


def check_clock_plan(schedules: list[dict], world_size: int, pp_rank_of, schedule: Schedule,
                     supported_clocks: list[int]) -> dict[int, list[tuple[str, int]]]:
    """Validate the per-rank schedules of a plan against the job; returns rank -> frequencies.

    Args:
        schedules: the plan's ``schedules``.
        world_size: ranks in the job; the plan must have exactly one schedule per rank.
        pp_rank_of: global rank -> pipeline rank.
        schedule: the programs the interpreter will run (``engine.schedule``).
        supported_clocks: the GPU's clocks (MHz).
    """
    by_rank: dict[int, list[tuple[str, int]]] = {}
    for entry in schedules:
        if not isinstance(entry, dict) or "rank" not in entry or "frequencies" not in entry:
            raise ClockPlanError(f"a plan schedule must be {{'rank': r, 'frequencies': "
                                 f"[[instruction, MHz], ...]}}, got {str(entry)[:80]}")
        rank = entry["rank"]
        if rank in by_rank:
            raise ClockPlanError(f"the plan has two schedules for rank {rank}")
        by_rank[rank] = [(str(name), int(mhz)) for name, mhz in entry["frequencies"]]
    if sorted(by_rank) != list(range(world_size)):
        raise ClockPlanError(f"the plan has schedules for ranks {sorted(by_rank)}, this job has "
                             f"{world_size} ranks (0..{world_size - 1}); plan for this job's "
                             f"layout")
    clocks = set(supported_clocks)
    for rank, freqs in by_rank.items():
        expected = expected_instructions(schedule, pp_rank_of(rank))
        names = [name for name, _ in freqs]
        if names != expected:
            where = next((i for i, (a, b) in enumerate(zip(names, expected)) if a != b),
                         min(len(names), len(expected)))
            raise ClockPlanError(f"rank {rank}: the plan's instruction order differs from the "
                                 f"schedule at position {where} (plan {names[where:where + 3]}, "
                                 f"schedule {expected[where:where + 3]}; {len(names)} vs "
                                 f"{len(expected)} instructions); plan with the same --schedule, "
                                 f"--stages, --microbatches, --interleave and --recompute as "
                                 f"training ({schedule.name}: {schedule.num_ranks} ranks x "
                                 f"{schedule.stages_per_rank} chunks, {schedule.num_microbatches} "
                                 f"micro-batches)")
        unknown = sorted({mhz for _, mhz in freqs} - clocks)
        if unknown:
            raise ClockPlanError(f"rank {rank}: clocks {unknown} MHz are not supported by this GPU "
                                 f"(supported {max(clocks)}..{min(clocks)} MHz)")
    return by_rank
