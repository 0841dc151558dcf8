"""Interleaved 1F1B (Megatron-LM; Narayanan et al., SC 2021): v model chunks per rank.

The model is split into ``p * v`` *virtual stages*; virtual stage k lives on rank ``k % p`` as
its chunk ``k // p``, so a micro-batch visits every rank v times. Each rank runs its chunks'
forwards and backwards in Megatron's order: ``2 (p - r - 1) + (v - 1) p`` warm-up forwards on
rank r, then one forward and one backward at a time, then the remaining backwards; forwards
walk the chunks up (p micro-batches through chunk 0, the same p through chunk 1, ...) and
backwards walk them down. A chunk costs 1/v of a stage, so the warm-up and drain, the bubble,
shrink v-fold: with forward f and backward b per stage a rank idles ``(p - 1)(f + b) / v``
instead of 1F1B's ``(p - 1)(f + b)``. The price: v times more p2p messages and, on the first
ranks, more micro-batch chunks in flight.

The schedule is data like every other (`InterleavedSchedule`): one program per rank, a list of
``(virtual_stage, Action)`` built from the same forward/backward blocks, and the per-virtual-stage
action lists derived from it. The simulator replays the programs (a rank serializes its chunks),
the validator proves them deadlock-free, `merak.pipeline.interleaved_runtime` runs them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from merak.pipeline.actions import Action, Schedule
from merak.pipeline.schedules import (
    Recompute,
    backward_block,
    check_sizes,
    forward_block,
    recompute_flags,
    step_tail,
)
from merak.pipeline.simulator import (
    CostModel,
    Edge,
    MemoryModel,
    ScheduleError,
    SimulationResult,
    _peers,
    _per_stage,
    chain_edges,
    replay_programs,
)
from merak.pipeline.validate import ValidationReport, _check_stage_order


@dataclass(frozen=True)
class InterleavedSchedule:
    """What every rank of an interleaved pipeline runs.

    Attributes:
        num_ranks: pipeline ranks p.
        num_chunks: model chunks per rank v (virtual stages: p * v).
        num_microbatches: micro-batches per step.
        programs: per rank, its ``(virtual_stage, action)`` pairs in execution order; the
            per-step tail (tied-grad and dp reduction, optimizer step) once, with stage None.
    """

    num_ranks: int
    num_chunks: int
    num_microbatches: int
    programs: tuple[tuple[tuple[int | None, Action], ...], ...]

    @property
    def num_stages(self) -> int:
        """Virtual stages, ``num_ranks * num_chunks``."""
        return self.num_ranks * self.num_chunks

    def rank_of(self, virtual_stage: int) -> int:
        return virtual_stage % self.num_ranks

    def chunk_of(self, virtual_stage: int) -> int:
        return virtual_stage // self.num_ranks

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.num_ranks + rank

    @property
    def virtual(self) -> Schedule:
        """Per virtual stage, its own actions in order, each list ending with the step tail (the
        schedule as if each virtual stage ran on its own device)."""
        stages: Schedule = [[] for _ in range(self.num_stages)]
        for program in self.programs:
            for stage_id, action in program:
                if stage_id is not None:
                    stages[stage_id].append(action)
        return [actions + step_tail() for actions in stages]

    def format(self) -> str:
        """One line per rank: ``action[mb]@virtual_stage`` separated by spaces."""
        return "\n".join(f"rank {r}: " + " ".join(str(a) if s is None else f"{a}@{s}"
                                                  for s, a in program)
                         for r, program in enumerate(self.programs))


def interleaved_order(rank: int, num_ranks: int, num_microbatches: int,
                      num_chunks: int) -> list[tuple[bool, int, int]]:
    """Rank `rank`'s Megatron order: ``(is_forward, chunk, microbatch_id)`` per compute unit."""
    p, v = num_ranks, num_chunks
    total = num_microbatches * v

    def unit(k: int, forward: bool) -> tuple[bool, int, int]:
        chunk = (k % (p * v)) // p
        return forward, chunk if forward else v - 1 - chunk, (k // (p * v)) * p + k % p

    num_warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [unit(k, True) for k in range(num_warmup)]
    for k in range(total - num_warmup):
        order += [unit(num_warmup + k, True), unit(k, False)]
    return order + [unit(k, False) for k in range(total - num_warmup, total)]


def check_interleaved_sizes(num_ranks: int, num_microbatches: int, num_chunks: int) -> None:
    """Raise ValueError unless v >= 2 and the micro-batches fill whole groups of p."""
    check_sizes(num_ranks, num_microbatches)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 2:
        raise ValueError(f"interleaved_1f1b needs num_chunks (--interleave) >= 2 model chunks "
                         f"per rank, got {num_chunks!r}; with one chunk per rank use 1f1b")
    if num_microbatches % num_ranks:
        raise ValueError(f"interleaved_1f1b needs the number of micro-batches "
                         f"({num_microbatches}) to be a multiple of the pipeline ranks "
                         f"({num_ranks}), as in Megatron-LM; use "
                         f"{(num_microbatches // num_ranks + 1) * num_ranks}")


def interleaved_1f1b(num_ranks: int, num_microbatches: int, num_chunks: int = 2,
                     recompute: Recompute = False) -> InterleavedSchedule:
    """Megatron's interleaved 1F1B on `num_ranks` ranks with `num_chunks` chunks each.

    Args:
        recompute: which virtual stages checkpoint activations (True: all, or one flag per
            virtual stage); their backward blocks then hold a `recompute` action.

    Raises:
        ValueError: fewer than 2 chunks, or micro-batches not a multiple of `num_ranks`.
    """
    check_interleaved_sizes(num_ranks, num_microbatches, num_chunks)
    num_stages = num_ranks * num_chunks
    flags = recompute_flags(recompute, num_stages)
    programs = []
    for rank in range(num_ranks):
        program: list[tuple[int | None, Action]] = []
        for forward, chunk, mb in interleaved_order(rank, num_ranks, num_microbatches,
                                                    num_chunks):
            stage_id = chunk * num_ranks + rank
            block = forward_block(stage_id, num_stages, mb) if forward else \
                backward_block(stage_id, num_stages, mb, flags[stage_id])
            program += [(stage_id, action) for action in block]
        program += [(None, action) for action in step_tail()]
        programs.append(tuple(program))
    return InterleavedSchedule(num_ranks, num_chunks, num_microbatches, tuple(programs))


INTERLEAVED_SCHEDULES = {"interleaved_1f1b": interleaved_1f1b}
"""Name -> generator ``(num_ranks, num_microbatches, num_chunks, recompute)`` of schedules whose
ranks host several virtual stages (not in `SCHEDULES`: their generators take `num_chunks` and
return an `InterleavedSchedule`)."""


def _per_virtual(value, schedule: InterleavedSchedule):
    """A per-rank cost (scalar or one per rank) as one value per virtual stage, a 1/v share."""
    if value is None:
        return None
    return [_per_stage(value, schedule.rank_of(k)) / schedule.num_chunks
            for k in range(schedule.num_stages)]


def simulate_interleaved(schedule: InterleavedSchedule, costs: CostModel | None = None,
                         edges: Iterable[Edge] | None = None,
                         memory: MemoryModel | None = None) -> SimulationResult:
    """Replay `schedule` with each rank running its virtual stages one action at a time.

    Costs and activation memories are per rank, as for the other schedules (a rank's whole
    share of the model: forward 1 means the rank's v chunks take 1 together); each chunk takes
    1/v of them. Busy, idle, peak in-flight (micro-batch chunks) and peak memory are per rank.

    Args:
        edges: activation edges between virtual stages; default the chain k -> k+1.
    """
    costs = costs or CostModel()
    memory = memory or MemoryModel()
    chunk_costs = CostModel(
        forward=_per_virtual(costs.forward, schedule), backward=_per_virtual(costs.backward,
                                                                             schedule),
        p2p=costs.p2p, step=costs.step, recompute=_per_virtual(costs.recompute, schedule),
        weight_grad=_per_virtual(costs.weight_grad, schedule))
    chunk_memory = MemoryModel(full=_per_virtual(memory.full, schedule),
                               kept=_per_virtual(memory.kept, schedule))
    return replay_programs(schedule.programs, schedule.num_stages, chunk_costs, edges,
                           chunk_memory)


def validate_interleaved(schedule: InterleavedSchedule,
                         edges: Iterable[Edge] | None = None) -> ValidationReport:
    """Prove `schedule` runnable: every virtual stage's own order is valid (`validate_schedule`'s
    per-stage checks), each rank runs only its own virtual stages and the step tail once, last,
    and a replay of the rank programs (non-blocking sends, blocking receives) finishes.

    Returns:
        The report, with peak in-flight micro-batch chunks per rank.

    Raises:
        ScheduleError: naming the rank or virtual stage, action and micro-batch at fault.
    """
    if len(schedule.programs) != schedule.num_ranks:
        raise ScheduleError(f"{len(schedule.programs)} programs for {schedule.num_ranks} ranks")
    edges = chain_edges(schedule.num_stages) if edges is None else frozenset(edges)
    upstream, downstream = _peers(edges, schedule.num_stages)
    for rank, program in enumerate(schedule.programs):
        tail = [action for stage_id, action in program if stage_id is None]
        if tail != step_tail() or any(s is None for s, _ in program[:-len(tail)]):
            raise ScheduleError(f"rank {rank}: the step tail {[str(a) for a in step_tail()]} "
                                f"must end its program, once")
        foreign = sorted({s for s, _ in program if s is not None and schedule.rank_of(s) != rank})
        if foreign:
            raise ScheduleError(f"rank {rank} runs virtual stages {foreign}, which live on "
                                f"other ranks")
    for stage_id, actions in enumerate(schedule.virtual):
        _check_stage_order(stage_id, actions, schedule.num_microbatches,
                           bool(upstream[stage_id]), bool(downstream[stage_id]))
    result = replay_programs(schedule.programs, schedule.num_stages, edges=edges)
    return ValidationReport(schedule.num_ranks, schedule.num_microbatches,
                            result.peak_activations)
