"""A rank's programs: the training schedule lowered for this rank with its recomputation, and
the forward-only programs of evaluation, measurement and shape discovery.

The interpreter only walks programs; what it walks is made here, from the schedule registry
(`merak.schedule`), the split's stage edges and the per-stage recomputation segments.
"""

from __future__ import annotations

from collections.abc import Sequence

from merak.recompute.stage_aware import stage_segments
from merak.schedule.actions import Action, ActionKind, Placement, Schedule
from merak.schedule.reference import runs_reference
from merak.schedule.registry import forward_schedule, make_schedule
from merak.schedule.validate import validate_schedule
from merak.stages.split import PipelineSplit


def training_schedule(spec: str | Schedule, split: PipelineSplit, pp: int,
                      stages_per_rank: int, num_microbatches: int,
                      ratio: float | Sequence[float], segment_size: int = 1,
                      placement: Placement | None = None
                      ) -> tuple[Schedule, list[list[list[int]]]]:
    """The validated training schedule `spec` (a registry name, or a `Schedule` checked to
    match, `placement` included when given) for a split of `pp` x `stages_per_rank` stages,
    and each stage's recomputed block segments for per-stage `ratio` (`stage_segments`),
    emptied where the schedule keeps the stage's activations. Every rank computes the same: an
    error is the same on every rank."""
    segments = stage_segments(split, ratio, segment_size)
    if isinstance(spec, str):
        schedule = make_schedule(spec, pp, num_microbatches, stages_per_rank=stages_per_rank,
                                 recompute=[bool(s) for s in segments],
                                 edges=split.edges or None)
    else:
        schedule = spec
    if (schedule.num_ranks, schedule.stages_per_rank, schedule.num_microbatches) != \
            (pp, stages_per_rank, num_microbatches):
        raise ValueError(f"the schedule is for {schedule.num_ranks} ranks x "
                         f"{schedule.stages_per_rank} stages per rank x "
                         f"{schedule.num_microbatches} micro-batches, not {pp} x "
                         f"{stages_per_rank} x {num_microbatches}")
    if placement is not None and schedule.placement != tuple(placement):
        raise ValueError(f"the schedule places the stages on ranks {list(schedule.placement)}, "
                         f"the stages were built for {list(placement)}")
    validate_schedule(schedule)
    if runs_reference(schedule):
        raise ValueError("the schedule runs a reference model's forwards in the step "
                         "(reference_forward, merak.schedule.reference): the planners count "
                         "them, the interpreter does not run them yet; DPO's and KTO's "
                         "references run in a pass before training (MerakTrainer)")
    for s in range(split.num_stages):
        if not any(a.kind is ActionKind.RECOMPUTE for a in schedule.stage_actions(s)):
            segments[s] = []  # the schedule keeps this stage's activations
        elif not segments[s]:
            raise ValueError(f"the schedule recomputes on stage {s}, which recomputes no "
                             f"blocks; raise its recompute_ratio or drop its recompute actions")
    return schedule, segments


def forward_program(split: PipelineSplit, pp: int, pp_rank: int, stages_per_rank: int,
                    num_microbatches: int, single_transfers: bool = False,
                    placement: Placement | None = None) -> list[Action]:
    """This rank's forward-only program over `num_microbatches` micro-batches (evaluation,
    activation measurement; with `single_transfers`, one value per message: shape discovery),
    the stages placed as the training schedule places them (default round-robin)."""
    schedule = forward_schedule(pp, num_microbatches, stages_per_rank=stages_per_rank,
                                edges=split.edges or None, single_transfers=single_transfers,
                                placement=placement)
    if single_transfers:
        validate_schedule(schedule, training=False)
    return list(schedule.programs[pp_rank])
