"""Prove a schedule executable before any rank runs it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from merak.pipeline.actions import BACKWARD_KINDS, STEP_KINDS, Action, ActionKind, Schedule
from merak.pipeline.simulator import Edge, ScheduleError, _peers, chain_edges, replay

K = ActionKind


@dataclass(frozen=True)
class ValidationReport:
    num_stages: int
    num_microbatches: int
    peak_activations: list[int]


def _check_stage_order(stage_id: int, actions: list[Action], num_microbatches: int,
                       has_upstream: bool, has_downstream: bool) -> None:
    """Per micro-batch: load/recv before forward before send; forward before recompute before
    backward; recv-grad before backward (or backward_input) before send-grad; backward_input
    before backward_weight; each exactly once; per-step actions after all of it."""
    position: dict[tuple[ActionKind, int | None], int] = {}
    for index, action in enumerate(actions):
        key = (action.kind, action.microbatch_id)
        if key in position:
            raise ScheduleError(f"stage {stage_id}: {action} appears twice "
                                f"(actions #{position[key]} and #{index})")
        position[key] = index
        if action.kind in STEP_KINDS and action.microbatch_id is not None:
            raise ScheduleError(f"stage {stage_id}: {action} is per step, not per micro-batch")
        if action.kind not in STEP_KINDS and not (
                action.microbatch_id is not None and 0 <= action.microbatch_id < num_microbatches):
            raise ScheduleError(f"stage {stage_id}: {action} names no micro-batch in "
                                f"0..{num_microbatches - 1}")
    split = any(a.kind is K.BACKWARD_INPUT for a in actions)
    grad = K.BACKWARD_INPUT if split else K.BACKWARD  # the action that makes input gradients
    required = [K.LOAD, K.FORWARD, *([K.BACKWARD_INPUT, K.BACKWARD_WEIGHT] if split
                                     else [K.BACKWARD])]
    required += [K.RECV_ACT, K.SEND_GRAD] if has_upstream else []
    required += [K.SEND_ACT, K.RECV_GRAD] if has_downstream else []
    order = [(K.LOAD, K.FORWARD), (K.RECV_ACT, K.FORWARD), (K.FORWARD, K.SEND_ACT),
             (K.FORWARD, K.RECOMPUTE), (K.RECOMPUTE, grad), (K.FORWARD, grad),
             (K.RECV_GRAD, grad), (grad, K.SEND_GRAD), (K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)]
    for mb in range(num_microbatches):
        for kind in required:
            if (kind, mb) not in position:
                raise ScheduleError(f"stage {stage_id}: micro-batch {mb} has no {kind.value}")
        if split and (K.BACKWARD, mb) in position:
            raise ScheduleError(f"stage {stage_id}: micro-batch {mb} has both backward and "
                                f"backward_input; a stage splits every backward or none")
        for first, then in order:
            a, b = position.get((first, mb)), position.get((then, mb))
            if a is not None and b is not None and a > b:
                raise ScheduleError(f"stage {stage_id}: micro-batch {mb}: {then.value} "
                                    f"(#{b}) comes before {first.value} (#{a})")
    last_backward = max(position[(kind, mb)] for mb in range(num_microbatches)
                        for kind in required if kind in BACKWARD_KINDS)
    for kind in STEP_KINDS:
        at = position.get((kind, None))
        if at is None:
            raise ScheduleError(f"stage {stage_id}: no {kind.value} in the step")
        if at < last_backward:
            raise ScheduleError(f"stage {stage_id}: {kind.value} (#{at}) runs before the last "
                                f"backward (#{last_backward})")
    if position[(K.REDUCE_GRADS, None)] > position[(K.OPTIMIZER_STEP, None)] or \
            position[(K.REDUCE_TIED_GRADS, None)] > position[(K.OPTIMIZER_STEP, None)]:
        raise ScheduleError(f"stage {stage_id}: gradients are reduced after the optimizer step")


def validate_schedule(schedule: Schedule, num_microbatches: int,
                      edges: Iterable[Edge] | None = None) -> ValidationReport:
    """Check that `schedule` can run and report its peak in-flight activations per stage.

    Checks every stage's order (see `_check_stage_order`), that each send has exactly one
    matching receive on each peer, and that a replay with non-blocking sends and blocking
    receives finishes (no deadlock).

    Raises:
        ScheduleError: naming the stage, action and micro-batch at fault.
    """
    num_stages = len(schedule)
    if num_stages == 0:
        raise ScheduleError("a schedule needs at least one stage")
    edges = chain_edges(num_stages) if edges is None else frozenset(edges)
    upstream, downstream = _peers(edges, num_stages)
    for stage_id, actions in enumerate(schedule):
        _check_stage_order(stage_id, actions, num_microbatches,
                           bool(upstream[stage_id]), bool(downstream[stage_id]))
    result = replay(schedule, edges=edges)
    return ValidationReport(num_stages, num_microbatches, result.peak_activations)
