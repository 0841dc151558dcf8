"""The schedule registry and `make_schedule`: a generator's block order, placed on the ranks
and lowered (`merak.schedule.lowering`) to the per-rank programs every tool reads.

Each registered schedule names its generator, its placement of stages on ranks (round-robin,
or the V of ZB-V and DualPipeV), how many stages a rank holds, and whether it needs
recomputation or splits the backward: every tool (simulator, validator, timeline, clock
frontier, stage-aware recomputation, strategy search, the runtime) reads these, so a new
schedule is one entry here and its generator.

Merak's schedules (TPDS 2023) move recomputation off 1F1B's critical path:
`pre_recompute_1f1b` reruns before the wait for the output gradient, `last_no_recompute_1f1b`
never recomputes on the last stage, `shifted_critical_path` does both. Merak also shifts the
first backwards of the last stages (extra warm-up forwards on stage p-2, a rerun before the
forward); a simulator search of those reorderings (every extra-warm-up vector within the memory
bound, p in 2..8, with and without p2p latency) found none that shortened the makespan, so
`shifted_critical_path` keeps 1F1B's order and in-flight bound. `zero_bubble` is ZB-H1 (Qi et
al., ICLR 2024); `interleaved_1f1b` is Megatron-LM's, for any number of micro-batches m >= p;
`zbv` and `dualpipev` place 2 stages per rank in a V (`merak.schedule.vshape`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from merak.schedule import generators as g
from merak.schedule import vshape
from merak.schedule.actions import (
    Action,
    ActionKind,
    Edge,
    Placement,
    Schedule,
    chain_edges,
    round_robin,
    v_shape,
)
from merak.schedule.lowering import lower
from merak.schedule.reference import with_reference

K = ActionKind
Recompute = bool | Sequence[bool]


@dataclass(frozen=True)
class ScheduleInfo:
    """One registered schedule.

    Attributes:
        name: the `train_schedule` value.
        generator: ``(num_ranks, num_microbatches, stages_per_rank, recompute) -> order``.
        needs_recompute: meaningless without activation recomputation (Merak's schedules).
        splits_backward: backwards run as `backward_input` + `backward_weight`.
        several_stages_per_rank: runs v >= 2 stages (model chunks) per rank.
        placement: ``(num_ranks, stages_per_rank) -> the rank of each stage``.
        fixed_stages_per_rank: the number of stages per rank the schedule is made for (2 for
            the V-shaped ones); None: the job's `num_model_chunks` (interleaved) or 1.
        min_microbatches_per_rank: it needs at least this many micro-batches per pipeline rank
            (interleaved 1F1B: 1).
        summary: one line for `--help` and error messages.
    """

    name: str
    generator: Callable[..., list[list[Action]]]
    needs_recompute: bool = False
    splits_backward: bool = False
    several_stages_per_rank: bool = False
    placement: Callable[[int, int], Placement] = round_robin
    fixed_stages_per_rank: int | None = None
    min_microbatches_per_rank: int = 0
    summary: str = ""

    def stages_per_rank(self, num_model_chunks: int = 2) -> int:
        """Stages per rank this schedule runs with a job's `num_model_chunks` (which only
        interleaved 1F1B reads)."""
        if self.fixed_stages_per_rank is not None:
            return self.fixed_stages_per_rank
        return num_model_chunks if self.several_stages_per_rank else 1


SCHEDULES: dict[str, ScheduleInfo] = {info.name: info for info in (
    ScheduleInfo("ds_default", g.gpipe, summary="GPipe: all forwards, then all backwards"),
    ScheduleInfo("1f1b", g.one_f_one_b, summary="one forward, one backward (PipeDream-flush)"),
    ScheduleInfo("pre_recompute_1f1b", g.pre_recompute_1f1b, needs_recompute=True,
                 summary="1F1B, each rerun before the wait for its output gradient"),
    ScheduleInfo("last_no_recompute_1f1b", g.last_no_recompute_1f1b, needs_recompute=True,
                 summary="1F1B, no recomputation on the last stage"),
    ScheduleInfo("shifted_critical_path", g.shifted_critical_path, needs_recompute=True,
                 summary="Merak's: early reruns and none on the last stage"),
    ScheduleInfo("zero_bubble", g.zero_bubble, splits_backward=True,
                 summary="ZB-H1: input gradients first, weight gradients fill the bubbles"),
    ScheduleInfo("interleaved_1f1b", g.interleaved_1f1b, several_stages_per_rank=True,
                 min_microbatches_per_rank=1,
                 summary="Megatron's interleaved 1F1B over v model chunks per rank"),
    ScheduleInfo("zbv", vshape.zbv, splits_backward=True, several_stages_per_rank=True,
                 placement=v_shape, fixed_stages_per_rank=2,
                 summary="ZB-V: zero-bubble order on 2 stages per rank placed in a V"),
    ScheduleInfo("dualpipev", vshape.dualpipev, splits_backward=True,
                 several_stages_per_rank=True, placement=v_shape, fixed_stages_per_rank=2,
                 summary="DualPipeV: forward-and-backward pairs on a V (not overlapped)"),
)}
"""Name -> `ScheduleInfo`."""


def schedule_info(name: str) -> ScheduleInfo:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown train_schedule {name!r}; choose one of "
                         f"{sorted(SCHEDULES)}") from None


def placement_of(schedule: str | Schedule, num_ranks: int, stages_per_rank: int) -> Placement:
    """The rank of each stage under `schedule` (a registry name, or a `Schedule`)."""
    if isinstance(schedule, Schedule):
        return schedule.placement
    return schedule_info(schedule).placement(num_ranks, stages_per_rank)


def step_tail() -> list[Action]:
    """Per-step actions after the last backward: tied and dp grad reduction, optimizer step."""
    return [Action(K.REDUCE_TIED_GRADS), Action(K.REDUCE_GRADS), Action(K.OPTIMIZER_STEP)]


def recompute_flags(recompute: Recompute, num_stages: int) -> list[bool]:
    """One flag per stage from True/False or a per-stage sequence."""
    if isinstance(recompute, bool):
        return [recompute] * num_stages
    flags = [bool(r) for r in recompute]
    if len(flags) != num_stages:
        raise ValueError(f"recompute has {len(flags)} flags for {num_stages} stages")
    return flags


def make_schedule(name: str, num_stages: int, num_microbatches: int, *,
                  stages_per_rank: int = 1, recompute: Recompute = False,
                  edges: Iterable[Edge] | None = None, reference: bool = False,
                  **options) -> Schedule:
    """The programs of schedule `name` on `num_stages` pipeline ranks.

    Args:
        stages_per_rank: model chunks per rank (interleaved schedules; 1 for the others).
        recompute: which stages recompute activations (True: all; or one flag per stage, of
            ``num_stages * stages_per_rank``).
        edges: activation edges between stages; default the chain.
        reference: a reference model's forward of each micro-batch on every stage before the
            policy's (`merak.schedule.reference.with_reference`: DPO's and KTO's reference run
            in every step).
        options: the generator's own (`interleaved_1f1b`: ``group_size``).

    Raises:
        ValueError: an unknown name, bad sizes, or a schedule that needs what is not given.
    """
    info = schedule_info(name)
    g.check_sizes(num_stages, num_microbatches)
    if not info.several_stages_per_rank and stages_per_rank != 1:
        raise ValueError(f"train_schedule {name!r} runs one stage per rank; num_model_chunks "
                         f"(--interleave) > 1 needs interleaved_1f1b")
    fixed = info.fixed_stages_per_rank
    if fixed is not None and stages_per_rank != fixed:
        raise ValueError(f"train_schedule {name!r} places {fixed} stages on every rank, not "
                         f"{stages_per_rank}")
    total = num_stages * stages_per_rank
    flags = recompute_flags(recompute, total)
    if info.needs_recompute and not any(flags):
        raise ValueError(f"train_schedule {name!r} reorders recomputation; turn on "
                         f"activation checkpointing (activation_checkpointing=True, or "
                         f"--recompute-cost in the simulator)")
    edges = chain_edges(total) if edges is None else frozenset(edges)
    order = info.generator(num_stages, num_microbatches, stages_per_rank, flags, **options)
    placement = info.placement(num_stages, stages_per_rank)
    schedule = Schedule(name, num_stages, stages_per_rank, num_microbatches,
                        lower(order, placement, edges, step_tail()), edges, placement)
    return with_reference(schedule) if reference else schedule


def forward_schedule(num_stages: int, num_microbatches: int, *, stages_per_rank: int = 1,
                     edges: Iterable[Edge] | None = None, single_transfers: bool = False,
                     placement: Placement | None = None) -> Schedule:
    """Forwards only (evaluation, activation measurement): no backward, no step tail, the
    stages placed as the training schedule places them (`placement`, default round-robin).
    With `single_transfers` every transfer is a group of its own (the runtime's shape
    discovery, which must finish one message before it can size the next)."""
    g.check_sizes(num_stages, num_microbatches)
    total = num_stages * stages_per_rank
    edges = chain_edges(total) if edges is None else frozenset(edges)
    placement = placement or round_robin(num_stages, stages_per_rank)
    order = g.forward_only(placement, num_microbatches)
    return Schedule("forward", num_stages, stages_per_rank, num_microbatches,
                    lower(order, placement, edges, single_transfers=single_transfers), edges,
                    placement)


def reference_pass(num_stages: int, num_microbatches: int, *, stages_per_rank: int = 1,
                   placement: Placement | None = None) -> Schedule:
    """The reference's pass before training over one step's micro-batches
    (`merak.schedule.reference`): a forward-only schedule whose forwards are
    ``reference_forward`` instructions, the stages placed as the training schedule places them
    (`placement`)."""
    forward = forward_schedule(num_stages, num_microbatches, stages_per_rank=stages_per_rank,
                               placement=placement)
    programs = tuple(tuple(dataclasses.replace(a, kind=K.REFERENCE_FORWARD)
                           if a.kind is K.FORWARD else a for a in program)
                     for program in forward.programs)
    return dataclasses.replace(forward, name="reference", programs=programs)
