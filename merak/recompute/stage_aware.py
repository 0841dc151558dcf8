"""Stage-aware recomputation: how many blocks each stage recomputes.

Under 1F1B stage s holds up to ``p - s`` micro-batches in flight, so with the same
recomputation on every stage the later stages keep far less than the first. Merak recomputes a
fraction of each stage's blocks that falls with the stage. Here the fraction comes from the
simulator's memory model instead of a formula: every stage measures, for each number k of
recomputed blocks, the bytes one micro-batch's forward keeps (`measure_kept`, by running it: the
tensors blocks share, such as rotary tables, are counted once, as at run time); the schedule is
replayed with those bytes (`MemoryModel`) and each stage takes the smallest k whose rank's
predicted peak fits the rank's budget. The budget is either given (``activation_memory_budget``)
or the first rank's own peak at its given ratio, so no rank peaks above the first. A rank
hosting several stages (interleaved and V-shaped schedules, wherever the schedule places them)
fits them together: stages are settled in order, the later ones of the rank still recomputing
everything, so each choice leaves room for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from merak.recompute.blocks import recomputed_blocks, recomputed_count
from merak.schedule.actions import Edge
from merak.schedule.registry import make_schedule, placement_of
from merak.schedule.simulator import MemoryModel, simulate
from merak.stages.split import PipelineSplit
from merak.stages.stage import block_names


def stage_segments(split: PipelineSplit, ratio: float | Sequence[float],
                   segment_size: int) -> list[list[list[int]]]:
    """Per stage, the segments of block indices it recomputes for `ratio` (one per stage, or
    one for all) in segments of `segment_size` blocks."""
    counts = [len(block_names(split, s)) for s in range(split.num_stages)]
    ratios = [float(ratio)] * len(counts) if isinstance(ratio, (int, float)) else list(ratio)
    if len(ratios) != len(counts):
        raise ValueError(f"recompute_ratio has {len(ratios)} values for {len(counts)} "
                         f"stages; give one per stage or a single value")
    if segment_size < 1:
        raise ValueError(f"checkpoint_num_layers must be >= 1, got {segment_size}")
    return [recomputed_blocks(n, r, segment_size) for n, r in zip(counts, ratios)]


@dataclass(frozen=True)
class KeptBytes:
    """Activation bytes of one micro-batch on one stage: ``by_count[k]`` is what its forward
    keeps for backward when the first k blocks are recomputed (``by_count[0]``: nothing
    recomputed, the full activations)."""

    by_count: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.by_count) - 1


def measure_kept(engine, batch, segment_size: int) -> list[KeptBytes]:
    """Every stage's `KeptBytes`, measured on micro-batch 0 of `batch` by `engine` (a
    `PipelineInterpreter`). A collective: every rank calls it; each returns the list for all
    stages. The random number generators are left as they were."""
    ctx, split = engine.ctx, engine.split
    counts = [len(block_names(split, s)) for s in range(split.num_stages)]
    own: dict[int, list[int]] = {s: [] for s in engine.runners}
    rng = engine.rng_state()
    try:
        for k in range(max(counts) + 1):  # every stage forwards in every round (p2p lock-step)
            segments = {s: recomputed_blocks(counts[s], min(k, counts[s]) / max(counts[s], 1),
                                               segment_size) for s in engine.runners}
            for s, value in engine.measure_forward(batch, segments).items():
                own[s].append(value)
    finally:
        engine.set_rng_state(rng)
    table = torch.zeros(split.num_stages, max(counts) + 1, dtype=torch.float64,
                        device=ctx.device)
    if ctx.dp_rank == 0 and ctx.tp_rank == 0:  # one rank per stage reports
        for s, values in own.items():
            table[s, :len(values)] = torch.tensor(values, dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(table)
    rows = table.cpu().tolist()
    return [KeptBytes(tuple(int(v) for v in rows[s][:counts[s] + 1]))
            for s in range(split.num_stages)]


def _peaks(schedule_name: str, num_ranks: int, num_microbatches: int, kept: Sequence[KeptBytes],
           counts: Sequence[int], edges: frozenset[Edge] | None) -> list[float]:
    """Peak activation bytes per rank with `counts` blocks recomputed per stage."""
    schedule = make_schedule(schedule_name, num_ranks, num_microbatches,
                             stages_per_rank=len(kept) // num_ranks,
                             recompute=[c > 0 for c in counts], edges=edges)
    memory = MemoryModel(full=[k.by_count[0] for k in kept],
                         kept=[k.by_count[c] for k, c in zip(kept, counts)], per_stage=True)
    return simulate(schedule, memory=memory).peak_memory


def predict_peaks(schedule_name: str, num_ranks: int, num_microbatches: int,
                  kept: Sequence[KeptBytes], ratios: Sequence[float],
                  edges: frozenset[Edge] | None = None) -> list[float]:
    """Each rank's peak activation bytes under the schedule with these per-stage ratios."""
    counts = [recomputed_count(k.num_blocks, r) for r, k in zip(ratios, kept)]
    return _peaks(schedule_name, num_ranks, num_microbatches, kept, counts, edges)


def _least_counts(schedule_name: str, num_ranks: int, num_microbatches: int,
                  kept: Sequence[KeptBytes], budget: Sequence[float],
                  edges: frozenset[Edge] | None, fixed: dict[int, int] | None = None,
                  ) -> tuple[list[int], list[int]]:
    """Per stage the fewest recomputed blocks whose rank's predicted peak fits the rank's
    budget (or all its blocks), and the stages that do not fit even so. Stages in `fixed`
    keep their count."""
    fixed = fixed or {}
    counts = [fixed.get(s, k.num_blocks) for s, k in enumerate(kept)]
    placement = placement_of(schedule_name, num_ranks, len(kept) // num_ranks)
    over = []
    for s, stage in enumerate(kept):
        if s in fixed:
            continue
        rank = placement[s]
        for k in range(stage.num_blocks + 1):
            counts[s] = k
            if _peaks(schedule_name, num_ranks, num_microbatches, kept, counts,
                      edges)[rank] <= budget[rank]:
                break
        else:
            over.append(s)
    return counts, over


def choose_ratios(schedule_name: str, num_ranks: int, num_microbatches: int,
                  kept: Sequence[KeptBytes], budget: Sequence[float],
                  edges: frozenset[Edge] | None = None) -> list[float]:
    """Per stage, the smallest fraction of blocks to recompute whose rank's predicted peak
    activation memory is within that rank's `budget` (bytes).

    Raises:
        ValueError: a rank exceeds its budget even recomputing every block (the error names
            the rank, the smallest peak it can reach and the budget).
    """
    counts, over = _least_counts(schedule_name, num_ranks, num_microbatches, kept, budget, edges)
    if over:
        placement = placement_of(schedule_name, num_ranks, len(kept) // num_ranks)
        rank = placement[over[0]]
        least = _peaks(schedule_name, num_ranks, num_microbatches, kept, counts, edges)[rank]
        blocks = sum(k.num_blocks for s, k in enumerate(kept) if placement[s] == rank)
        raise ValueError(f"stage {rank} needs {least / 2**20:.2f} MiB of activations even "
                         f"recomputing all its {blocks} blocks, above its budget of "
                         f"{budget[rank] / 2**20:.2f} MiB; raise activation_memory_budget, or "
                         f"use smaller micro-batches or more pipeline stages")
    return [c / k.num_blocks if k.num_blocks else 0.0 for c, k in zip(counts, kept)]


def stage_aware_ratios(schedule_name: str, num_ranks: int, num_microbatches: int,
                       kept: Sequence[KeptBytes], first_ratio: float,
                       edges: frozenset[Edge] | None = None) -> list[float]:
    """The first rank's stages recompute `first_ratio` of their blocks; every other stage the
    least that keeps its rank's predicted peak at or below the first rank's (all its blocks
    where even that does not: a last stage whose head outweighs the first stage's in-flight
    micro-batches)."""
    placement = placement_of(schedule_name, num_ranks, len(kept) // num_ranks)
    first = {s: recomputed_count(k.num_blocks, first_ratio) for s, k in enumerate(kept)
             if placement[s] == 0}
    counts = [first.get(s, k.num_blocks) for s, k in enumerate(kept)]
    first_peak = _peaks(schedule_name, num_ranks, num_microbatches, kept, counts, edges)[0]
    counts, _ = _least_counts(schedule_name, num_ranks, num_microbatches, kept,
                              [first_peak] * num_ranks, edges, fixed=first)
    return [c / k.num_blocks if k.num_blocks else 0.0 for c, k in zip(counts, kept)]
