"""Energy profiles: the CSV the profiler writes and the planner reads, and their clean-up.

One row per (rank, instruction, clock): ``rank, dp_rank, pp_rank, tp_rank, stage, instruction,
frequency, time, energy`` (seconds and joules per instruction). Rows whose instruction is
``p2p`` give the power drawn while blocked on communication: energy / time (frequency 0).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank", "stage", "instruction", "frequency", "time",
           "energy")
COMPUTE = ("forward", "backward")


@dataclass(frozen=True)
class ProfileRow:
    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    stage: int
    instruction: str
    frequency: int
    time: float
    energy: float


def write_profile(rows: list[ProfileRow], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([getattr(row, c) for c in COLUMNS])
    return path


def read_profile(path: str | Path) -> list[ProfileRow]:
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: the profile lacks columns {missing}; expected {COLUMNS}")
        rows = []
        for line, record in enumerate(reader, start=2):
            try:
                rows.append(ProfileRow(
                    *(int(record[c]) for c in COLUMNS[:5]), record["instruction"],
                    int(float(record["frequency"])), float(record["time"]),
                    float(record["energy"])))
            except ValueError as error:
                raise ValueError(f"{path}:{line}: {error}") from None
    if not rows:
        raise ValueError(f"{path}: the profile has no rows")
    return rows


@dataclass
class StageProfile:
    """What the planner needs of one stage: per instruction, clock -> (time, energy) with the
    ranks of the stage aggregated (time: the slowest rank, energy: the sum), and its ranks."""

    stage: int
    ranks: list[int]
    options: dict[str, dict[int, tuple[float, float]]]


def aggregate(rows: list[ProfileRow]) -> tuple[list[StageProfile], float | None]:
    """Stage profiles (cleaned, see `clean`) and the measured blocked-p2p power per GPU
    (mean over the ``p2p`` rows; None without any)."""
    ranks: dict[int, set[int]] = defaultdict(set)
    merged: dict[tuple[int, str, int], list[float]] = {}
    p2p_power = []
    for row in rows:
        ranks[row.stage].add(row.rank)
        if row.instruction == "p2p":
            if row.time > 0:
                p2p_power.append(row.energy / row.time)
            continue
        if row.instruction not in COMPUTE:
            raise ValueError(f"unknown instruction {row.instruction!r} in the profile (rank "
                             f"{row.rank}); expected one of {COMPUTE} or 'p2p'")
        slot = merged.setdefault((row.stage, row.instruction, row.frequency), [0.0, 0.0])
        slot[0] = max(slot[0], row.time)
        slot[1] += row.energy
    stages = sorted(ranks)
    if stages != list(range(len(stages))):
        raise ValueError(f"the profile covers stages {stages}; it must cover 0..{len(stages) - 1}")
    profiles = []
    for s in stages:
        options: dict[str, dict[int, tuple[float, float]]] = {}
        for instruction in COMPUTE:
            table = {f: (t, e) for (st, ins, f), (t, e) in merged.items()
                     if st == s and ins == instruction}
            if not table:
                raise ValueError(f"stage {s} has no {instruction} rows in the profile")
            options[instruction] = clean(table)
        profiles.append(StageProfile(s, sorted(ranks[s]), options))
    power = sum(p2p_power) / len(p2p_power) if p2p_power else None
    return profiles, power


def clean(table: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """Measured noise out: time must not fall as the clock falls (a lower clock measured faster
    takes the time of the faster clock above it). The highest clock is always kept."""
    cleaned, slowest = {}, 0.0
    for mhz in sorted(table, reverse=True):
        time, energy = table[mhz]
        slowest = max(slowest, time)
        cleaned[mhz] = (slowest, energy)
    return cleaned


def synthetic_profile(model, num_stages: int, gpus_per_stage: int = 1) -> list[ProfileRow]:
    """The profile a `SyntheticGPUModel` GPU would measure, exactly (for planner tests and the
    benchmark): every clock, forward and backward, and one p2p row per rank."""
    rows = []
    for stage in range(num_stages):
        for local in range(gpus_per_stage):
            rank = stage * gpus_per_stage + local
            where = (rank, local, stage, 0, stage)
            for instruction in COMPUTE:
                rows += [ProfileRow(*where, instruction, mhz,
                                    model.time(instruction, stage, num_stages, mhz),
                                    model.energy(instruction, stage, num_stages, mhz))
                         for mhz in model.clocks()]
            rows.append(ProfileRow(*where, "p2p", 0, 1.0, model.p2p_w))
    return rows
