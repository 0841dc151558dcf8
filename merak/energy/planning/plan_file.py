"""The plan file: ``{"predicted": {...}, "baseline": {...}, "schedules": [...]}``.

``schedules`` holds one Zeus-style FrequencySchedule per rank,
``{"rank": r, "frequencies": [["forward", 1410], ["backward", 1215], ...]}``: the compute
instructions of the rank's pipeline program in program order (`expected_instructions`; with
several model chunks per rank, every chunk's). `check_clock_plan` rejects a plan that does not
fit the job before training starts.
"""

from __future__ import annotations

import json
import math
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
    """The plan in file `path`, its structure checked (`validate_clock_plan`)."""
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ClockPlanError(f"cannot read the energy plan {path}: {error}") from None
    return validate_clock_plan(body, str(path))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def validate_clock_plan(body, where: str = "the plan") -> dict:
    """`body` if it is a whole plan (whatever job it is for): one schedule per rank 0..n-1,
    each a list of [instruction name, MHz > 0]; ``meta.stages`` dividing n; finite predicted
    and baseline figures. Raises `ClockPlanError` naming the first fault (before a server
    serves it or a trainer reads it)."""
    def fault(what: str) -> ClockPlanError:
        return ClockPlanError(f"{where} is not a valid energy plan: {what} (write one with "
                              f"`merak energy plan`)")

    if not isinstance(body, dict) or not isinstance(body.get("schedules"), list) \
            or not body["schedules"]:
        raise fault("it needs a non-empty 'schedules' list")
    ranks = []
    for index, entry in enumerate(body["schedules"]):
        if not isinstance(entry, dict) or not _is_int(entry.get("rank")) or entry["rank"] < 0 \
                or not isinstance(entry.get("frequencies"), list):
            raise fault(f"schedule {index} must be {{'rank': r >= 0, 'frequencies': "
                        f"[[instruction, MHz], ...]}}, got {str(entry)[:80]}")
        for pair in entry["frequencies"]:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                    and isinstance(pair[0], str) and _is_int(pair[1]) and pair[1] > 0):
                raise fault(f"rank {entry['rank']}'s frequencies must be [instruction, MHz > 0] "
                            f"pairs, got {str(pair)[:60]}")
        ranks.append(entry["rank"])
    if sorted(ranks) != list(range(len(ranks))):
        raise fault(f"its schedules are for ranks {sorted(ranks)[:16]}, not each of "
                    f"0..{len(ranks) - 1} once")
    meta = body.get("meta", {})
    stages = meta.get("stages") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or (stages is not None and not (
            _is_int(stages) and stages >= 1 and len(ranks) % stages == 0)):
        raise fault(f"meta.stages must be a pipeline degree dividing its {len(ranks)} ranks, "
                    f"got {str(meta)[:80]}")
    for name in ("predicted", "baseline"):
        figures = body.get(name)
        if figures is not None and not (isinstance(figures, dict) and all(
                _is_number(figures.get(k)) and figures[k] >= 0 for k in ("time_s", "energy_j"))):
            raise fault(f"{name} must hold finite time_s and energy_j >= 0, got "
                        f"{str(figures)[:80]}")
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
