"""Energy profiles: the CSV the profiler writes and the planner reads, and their clean-up.

One row per (rank, instruction, clock): ``rank, dp_rank, pp_rank, tp_rank, stage, instruction,
frequency, time, energy`` (seconds and joules per instruction). Instructions are the compute
kinds the rank's schedule runs (`COMPUTE`: forward, backward, recompute, backward_input,
backward_weight); a rank hosting several model chunks (interleaved schedules) averages its
chunks (each chunk's forward is one ``forward`` instruction). ``stage`` repeats the pipeline
rank (older profiles). Rows whose instruction is ``p2p`` give the power drawn while blocked on
communication: energy / time (frequency 0).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from merak.schedule.actions import ActionKind

COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank", "stage", "instruction", "frequency", "time",
           "energy")
COMPUTE = tuple(k.value for k in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE,
                                  ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT,
                                  ActionKind.REFERENCE_FORWARD))
"""The instructions a clock plan sets a clock for (`merak.schedule.actions.COMPUTE_KINDS`)."""


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
class RankProfile:
    """What the planner needs of one pipeline rank: per instruction kind, clock -> (time,
    energy) with the GPUs of the rank (its dp x tp ranks) aggregated (time: the slowest,
    energy: the sum), and those GPUs' global ranks."""

    pp_rank: int
    ranks: list[int]
    options: dict[str, dict[int, tuple[float, float]]]


def aggregate(rows: list[ProfileRow]) -> tuple[list[RankProfile], float | None]:
    """Per pipeline rank profiles (cleaned, see `clean`) and the measured blocked-p2p power per
    GPU (mean over the ``p2p`` rows; None without any). A rank has the instruction kinds its
    rows have; the planner asks for those its schedule runs."""
    ranks: dict[int, set[int]] = defaultdict(set)
    merged: dict[tuple[int, str, int], list[float]] = {}
    p2p_power = []
    for row in rows:
        ranks[row.pp_rank].add(row.rank)
        if row.instruction == "p2p":
            if row.time > 0:
                p2p_power.append(row.energy / row.time)
            continue
        if row.instruction not in COMPUTE:
            raise ValueError(f"unknown instruction {row.instruction!r} in the profile (rank "
                             f"{row.rank}); expected one of {COMPUTE} or 'p2p'")
        slot = merged.setdefault((row.pp_rank, row.instruction, row.frequency), [0.0, 0.0])
        slot[0] = max(slot[0], row.time)
        slot[1] += row.energy
    pipeline = sorted(ranks)
    if pipeline != list(range(len(pipeline))):
        raise ValueError(f"the profile covers pipeline ranks {pipeline}; it must cover "
                         f"0..{len(pipeline) - 1}")
    profiles = []
    for r in pipeline:
        options: dict[str, dict[int, tuple[float, float]]] = {}
        for instruction in COMPUTE:
            table = {f: (t, e) for (pr, ins, f), (t, e) in merged.items()
                     if pr == r and ins == instruction}
            if table:
                options[instruction] = clean(table)
        if not options:
            raise ValueError(f"pipeline rank {r} has no compute rows in the profile")
        profiles.append(RankProfile(r, sorted(ranks[r]), options))
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


def synthetic_profile(model, num_ranks: int, gpus_per_rank: int = 1, chunks: int = 1,
                      instructions: tuple[str, ...] = COMPUTE) -> list[ProfileRow]:
    """The profile a `SyntheticGPUModel` GPU would measure, exactly (for planner tests and the
    benchmark): every clock of every instruction in `instructions` (default: every compute
    kind), with `chunks` model chunks per rank, and one p2p row per GPU."""
    rows = []
    for pp_rank in range(num_ranks):
        for local in range(gpus_per_rank):
            rank = pp_rank * gpus_per_rank + local
            where = (rank, local, pp_rank, 0, pp_rank)
            for instruction in instructions:
                rows += [ProfileRow(*where, instruction, mhz,
                                    model.time(instruction, pp_rank, num_ranks, mhz, chunks),
                                    model.energy(instruction, pp_rank, num_ranks, mhz, chunks))
                         for mhz in model.clocks()]
            rows.append(ProfileRow(*where, "p2p", 0, 1.0, model.p2p_w))
    return rows
