"""Stage-aware recomputation: how many blocks each stage recomputes.

Under 1F1B stage s holds up to ``p - s`` micro-batches in flight, so with the same
recomputation on every stage the later stages keep far less than the first. Merak recomputes a
fraction of each stage's blocks that falls with the stage. Here the fraction comes from the
simulator's memory model instead of a formula: every stage measures, for each number k of
recomputed blocks, the bytes one micro-batch's forward keeps (`measure_kept`, by running it: the
tensors blocks share, such as rotary tables, are counted once, as at run time); the schedule is
replayed with those bytes (`MemoryModel`) and each stage takes the smallest k whose predicted
peak fits its budget. The budget is either given (``activation_memory_budget``) or the first
stage's own peak at its given ratio, so no stage peaks above the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from merak.pipeline.recompute import checkpointed_blocks, recomputed_count
from merak.pipeline.schedules import make_schedule
from merak.pipeline.simulator import Edge, MemoryModel, simulate
from merak.pipeline.split import PipelineSplit
from merak.pipeline.stage import block_names


def stage_chunks(split: PipelineSplit, ratio: float | Sequence[float],
                 chunk: int) -> list[list[list[int]]]:
    """Per stage, the chunks of block indices it recomputes for `ratio` (one per stage, or
    one for all) in chunks of `chunk` blocks."""
    counts = [len(block_names(split, s)) for s in range(split.num_stages)]
    ratios = [float(ratio)] * len(counts) if isinstance(ratio, (int, float)) else list(ratio)
    if len(ratios) != len(counts):
        raise ValueError(f"recompute_ratio has {len(ratios)} values for {len(counts)} "
                         f"stages; give one per stage or a single value")
    if chunk < 1:
        raise ValueError(f"checkpoint_num_layers must be >= 1, got {chunk}")
    return [checkpointed_blocks(n, r, chunk) for n, r in zip(counts, ratios)]


@dataclass(frozen=True)
class KeptBytes:
    """Activation bytes of one micro-batch on one stage: ``by_count[k]`` is what its forward
    keeps for backward when the first k blocks are recomputed (``by_count[0]``: nothing
    recomputed, the full activations)."""

    by_count: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.by_count) - 1


def measure_kept(engine, batch, chunk: int) -> list[KeptBytes]:
    """Every stage's `KeptBytes`, measured on micro-batch 0 of `batch` by `engine`
    (a `PipelineInterpreter`). A collective: every rank calls it; each returns the list for
    all stages. The random number generators are left as they were."""
    ctx = engine.ctx
    counts = [len(block_names(engine.split, s)) for s in range(ctx.pp)]
    n = counts[ctx.stage_id]
    own = []
    rng = engine.recompute.rng_state()
    try:
        for k in range(max(counts) + 1):  # every stage forwards in every round (p2p lock-step)
            chunks = checkpointed_blocks(n, min(k, n) / max(n, 1), chunk)
            own.append(engine.measure_forward(batch, chunks))
    finally:
        engine.recompute.set_rng_state(rng)
    table = torch.zeros(ctx.pp, max(counts) + 1, dtype=torch.float64)
    if ctx.dp_rank == 0 and ctx.tp_rank == 0:  # one rank per stage reports
        table[ctx.stage_id, :len(own)] = torch.tensor(own, dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(table)
    return [KeptBytes(tuple(int(v) for v in table[s, :counts[s] + 1].tolist()))
            for s in range(ctx.pp)]


def _peak(schedule_name: str, num_microbatches: int, kept: Sequence[KeptBytes],
          counts: Sequence[int], edges: frozenset[Edge] | None) -> list[float]:
    schedule = make_schedule(schedule_name, len(kept), num_microbatches,
                             recompute=[c > 0 for c in counts])
    memory = MemoryModel(full=[k.by_count[0] for k in kept],
                         kept=[k.by_count[c] for k, c in zip(kept, counts)])
    return simulate(schedule, edges=edges, memory=memory).peak_memory


def predict_peaks(schedule_name: str, num_microbatches: int, kept: Sequence[KeptBytes],
                  ratios: Sequence[float], edges: frozenset[Edge] | None = None) -> list[float]:
    """Each stage's peak activation bytes under the schedule with these per-stage ratios."""
    counts = [recomputed_count(k.num_blocks, r) for r, k in zip(ratios, kept)]
    return _peak(schedule_name, num_microbatches, kept, counts, edges)


def _least_counts(schedule_name: str, num_microbatches: int, kept: Sequence[KeptBytes],
                  budget: Sequence[float], edges: frozenset[Edge] | None,
                  ) -> tuple[list[int], list[int]]:
    """Per stage the fewest recomputed blocks whose predicted peak fits its budget (or all its
    blocks), and the stages that do not fit even so."""
    counts = [k.num_blocks for k in kept]  # the others at their most: schedules that need some
    over = []                               # recomputation can always be built
    for s, stage in enumerate(kept):
        for k in range(stage.num_blocks + 1):
            counts[s] = k
            # a stage's memory depends on its own actions only: the others' counts do not matter
            if _peak(schedule_name, num_microbatches, kept, counts, edges)[s] <= budget[s]:
                break
        else:
            over.append(s)
    return counts, over


def choose_ratios(schedule_name: str, num_microbatches: int, kept: Sequence[KeptBytes],
                  budget: Sequence[float], edges: frozenset[Edge] | None = None) -> list[float]:
    """Per stage, the smallest fraction of blocks to recompute whose predicted peak activation
    memory is within that stage's `budget` (bytes).

    Raises:
        ValueError: a stage exceeds its budget even recomputing every block (the error names
            the stage, the smallest peak it can reach and the budget).
    """
    counts, over = _least_counts(schedule_name, num_microbatches, kept, budget, edges)
    if over:
        s = over[0]
        least = _peak(schedule_name, num_microbatches, kept, counts, edges)[s]
        raise ValueError(f"stage {s} needs {least / 2**20:.2f} MiB of activations even "
                         f"recomputing all its {kept[s].num_blocks} blocks, above its budget of "
                         f"{budget[s] / 2**20:.2f} MiB; raise activation_memory_budget, or use "
                         f"smaller micro-batches or more pipeline stages")
    return [c / k.num_blocks if k.num_blocks else 0.0 for c, k in zip(counts, kept)]


def stage_aware_ratios(schedule_name: str, num_microbatches: int, kept: Sequence[KeptBytes],
                       first_ratio: float, edges: frozenset[Edge] | None = None) -> list[float]:
    """Stage 0 recomputes `first_ratio` of its blocks; every later stage the least that keeps
    its predicted peak at or below stage 0's (all its blocks where even that does not: a last
    stage whose head outweighs the first stage's in-flight micro-batches)."""
    counts = [recomputed_count(kept[0].num_blocks, first_ratio)] + [k.num_blocks
                                                                    for k in kept[1:]]
    first_peak = _peak(schedule_name, num_microbatches, kept, counts, edges)[0]
    counts, _ = _least_counts(schedule_name, num_microbatches, kept, [first_peak] * len(kept),
                              edges)
    return [first_ratio] + [c / k.num_blocks if k.num_blocks else 0.0
                            for c, k in zip(counts[1:], kept[1:])]
