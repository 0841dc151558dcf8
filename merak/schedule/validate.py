"""Prove a schedule runnable under NCCL's point-to-point rules before any rank runs it.

NCCL ignores tags: between two ranks, messages pair up in the order they were posted. A rank's
sends and receives run one after another on one stream, except those posted together in one
``batch_isend_irecv`` group, and a send completes only once the matching receive runs. The
replay here follows exactly those rules (one FIFO stream per rank, a group finishing when every
one of its transfers met its partner) and rejects a program that would deadlock or pair a
message with the wrong receive; it also checks each stage's own order (data before use, each
action once, the step tail last).
"""

from __future__ import annotations

from dataclasses import dataclass

from merak.schedule.actions import (
    P2P_KINDS,
    RECV_KINDS,
    STEP_KINDS,
    ActionKind,
    Schedule,
)
from merak.schedule.errors import ScheduleError

K = ActionKind


@dataclass(frozen=True)
class ValidationReport:
    num_ranks: int
    num_microbatches: int
    num_groups: list[int]  # posting groups per rank and step


def _check_stage_order(schedule: Schedule, stage_id: int, training: bool) -> None:
    """Per micro-batch: receive and load before forward before send; forward before recompute
    before backward; output grads before backward (or backward_input) before input grads;
    backward_input before backward_weight; each exactly once."""
    actions = schedule.stage_actions(stage_id)
    m = schedule.num_microbatches
    upstream = sorted(s for s, d in schedule.edges if d == stage_id)
    downstream = sorted(d for s, d in schedule.edges if s == stage_id)
    position: dict[tuple, int] = {}
    for index, action in enumerate(actions):
        key = (action.kind, action.microbatch_id, action.peer_stage)
        if key in position:
            raise ScheduleError(f"stage {stage_id}: {action} appears twice "
                                f"(actions #{position[key]} and #{index})")
        position[key] = index
        if action.microbatch_id is None or not 0 <= action.microbatch_id < m:
            raise ScheduleError(f"stage {stage_id}: {action} names no micro-batch in 0..{m - 1}")
    # a forward-only pass of the reference model runs reference_forward in place of forward
    # (`merak.schedule.registry.reference_pass`); a training step may run one before each
    # forward (`merak.schedule.reference.with_reference`)
    forward = K.FORWARD if training or any(a.kind is K.FORWARD for a in actions) \
        else K.REFERENCE_FORWARD
    reference = forward is K.FORWARD and any(a.kind is K.REFERENCE_FORWARD for a in actions)
    split = any(a.kind is K.BACKWARD_INPUT for a in actions)
    grad = K.BACKWARD_INPUT if split else K.BACKWARD  # the action that makes input gradients
    for mb in range(m):
        def at(kind: ActionKind, peer: int | None = None, *, mb: int = mb) -> int | None:
            return position.get((kind, mb, peer))  # mb bound now: called in this iteration only

        required = [(K.LOAD, None), (forward, None)] + [(K.RECV_ACT, u) for u in upstream] \
            + [(K.SEND_ACT, d) for d in downstream]
        if reference:
            required.append((K.REFERENCE_FORWARD, None))
        if training:
            required += [(K.BACKWARD_INPUT, None), (K.BACKWARD_WEIGHT, None)] if split \
                else [(K.BACKWARD, None)]
            required += [(K.SEND_GRAD, u) for u in upstream] + \
                [(K.RECV_GRAD, d) for d in downstream]
        for kind, peer in required:
            if at(kind, peer) is None:
                extra = f" with stage {peer}" if peer is not None else ""
                raise ScheduleError(f"stage {stage_id}: micro-batch {mb} has no "
                                    f"{kind.value}{extra}")
        if split and at(K.BACKWARD) is not None:
            raise ScheduleError(f"stage {stage_id}: micro-batch {mb} has both backward and "
                                f"backward_input; a stage splits every backward or none")
        before = [(K.LOAD, None, forward, None), (K.FORWARD, None, K.RECOMPUTE, None),
                  (K.RECOMPUTE, None, grad, None), (K.FORWARD, None, grad, None),
                  (K.BACKWARD_INPUT, None, K.BACKWARD_WEIGHT, None)]
        before += [(K.RECV_ACT, u, forward, None) for u in upstream]
        before += [(grad, None, K.SEND_GRAD, u) for u in upstream]
        before += [(forward, None, K.SEND_ACT, d) for d in downstream]
        if reference:  # both models' activations arrive and leave in the same messages
            before += [(K.LOAD, None, K.REFERENCE_FORWARD, None),
                       (K.REFERENCE_FORWARD, None, K.FORWARD, None)]
            before += [(K.RECV_ACT, u, K.REFERENCE_FORWARD, None) for u in upstream]
        before += [(K.RECV_GRAD, d, grad, None) for d in downstream]
        for first, p1, then, p2 in before:
            a, b = at(first, p1), at(then, p2)
            if a is not None and b is not None and a > b:
                raise ScheduleError(f"stage {stage_id}: micro-batch {mb}: {then.value} "
                                    f"(#{b}) comes before {first.value} (#{a})")


def _check_rank(schedule: Schedule, rank: int, training: bool) -> int:
    """Own stages only, peers consistent, groups contiguous, the step tail once and last.
    Returns the number of groups."""
    program = schedule.programs[rank]
    own = set(schedule.stages_of(rank))
    tail = [a for a in program if a.kind in STEP_KINDS]
    if training:
        kinds = [a.kind for a in tail]
        if kinds != [K.REDUCE_TIED_GRADS, K.REDUCE_GRADS, K.OPTIMIZER_STEP] or \
                list(program[-3:]) != tail:
            raise ScheduleError(f"rank {rank}: the step tail (reduce_tied_grads, reduce_grads, "
                                f"optimizer_step) must end its program, once")
    elif tail:
        raise ScheduleError(f"rank {rank}: a forward-only program has per-step actions")
    seen_groups: list[int] = []
    handed: set[tuple] = set()  # local hand-offs sent so far
    for action in program:
        if action.kind in STEP_KINDS:
            if action.stage_id is not None or action.microbatch_id is not None:
                raise ScheduleError(f"rank {rank}: {action} is per step, not per stage")
            continue
        if action.stage_id not in own:
            raise ScheduleError(f"rank {rank} runs {action} of stage {action.stage_id}, which "
                                f"lives on rank {schedule.rank_of(action.stage_id)}")
        if action.kind in P2P_KINDS:
            edge = (action.stage_id, action.peer_stage) if action.kind in (K.SEND_ACT,
                                                                        K.RECV_GRAD) \
                else (action.peer_stage, action.stage_id)
            if edge not in schedule.edges or action.peer != schedule.rank_of(action.peer_stage):
                raise ScheduleError(f"rank {rank}: {action} (peer rank {action.peer}) is not "
                                    f"a transfer of the split's edges")
            if action.peer == rank:
                if action.group is not None:
                    raise ScheduleError(f"rank {rank}: {action} would send to itself in a "
                                        f"posting group (stages {action.stage_id} and "
                                        f"{action.peer_stage} share the rank: a local "
                                        f"hand-off belongs to no group)")
                if action.kind in RECV_KINDS and action.message not in handed:
                    raise ScheduleError(f"rank {rank}: {action} takes a local hand-off "
                                        f"before it is handed over")
                handed.add(action.message)
                continue
            if action.group is None:
                raise ScheduleError(f"rank {rank}: {action} belongs to no posting group")
            if not seen_groups or seen_groups[-1] != action.group:
                if action.group in seen_groups:
                    raise ScheduleError(f"rank {rank}: group {action.group} is split by other "
                                        f"actions; a group is posted at once")
                seen_groups.append(action.group)
        elif action.group is not None:
            raise ScheduleError(f"rank {rank}: {action} is no transfer but has a group")
    return len(seen_groups)


def replay_nccl(schedule: Schedule) -> None:
    """Replay the programs under NCCL's rules; raise `ScheduleError` on a deadlock (naming
    every blocked rank and what its current group waits for) or a mispairing (naming the two
    ranks and actions)."""
    p = schedule.num_ranks
    groups = [list(schedule.groups(r)) for r in range(p)]
    head = [0] * p
    unmatched: list[int | None] = [None] * p   # transfers of the head group still unmatched
    channels: dict[tuple[int, int], tuple[list, list]] = {}
    progress = True
    while progress:
        progress = False
        for r in range(p):
            if unmatched[r] is None and head[r] < len(groups[r]):
                _, actions = groups[r][head[r]]
                unmatched[r] = len(actions)
                for a in actions:
                    key = (a.peer, r) if a.kind in RECV_KINDS else (r, a.peer)
                    sends, recvs = channels.setdefault(key, ([], []))
                    (recvs if a.kind in RECV_KINDS else sends).append((r, a))
        for sends, recvs in channels.values():
            while sends and recvs:
                (r1, a1), (r2, a2) = sends.pop(0), recvs.pop(0)
                if a1.message != a2.message:
                    raise ScheduleError(
                        f"rank {r1} posts {a1} while rank {r2} posts {a2} on the same rank "
                        f"pair: NCCL would pair them (it ignores tags and matches in posting "
                        f"order), swapping tensors")
                unmatched[r1] -= 1
                unmatched[r2] -= 1
        for r in range(p):
            if unmatched[r] == 0:
                head[r] += 1
                unmatched[r] = None
                progress = True
    blocked = [r for r in range(p) if head[r] < len(groups[r])]
    if blocked:
        waits = []
        for r in blocked:
            _, actions = groups[r][head[r]]
            waits.append(f"rank {r} in group {head[r]} [" + ", ".join(map(str, actions)) + "]")
        raise ScheduleError("the programs deadlock under NCCL's rules (one ordered stream per "
                            "rank, a send completes only when its receive runs): "
                            + "; ".join(waits))


def validate_schedule(schedule: Schedule, training: bool | None = None) -> ValidationReport:
    """Check that `schedule` can run: every stage's order, every rank's program, and the NCCL
    replay.

    Args:
        training: whether backwards and the step tail are required; default: the programs
            hold an optimizer step.

    Raises:
        ScheduleError: naming the rank or stage, action and micro-batch at fault.
    """
    if len(schedule.programs) != schedule.num_ranks:
        raise ScheduleError(f"{len(schedule.programs)} programs for {schedule.num_ranks} ranks")
    if training is None:
        training = any(a.kind is K.OPTIMIZER_STEP for prog in schedule.programs for a in prog)
    for src, dst in schedule.edges:
        if not 0 <= src < dst < schedule.num_stages:
            raise ScheduleError(f"edge {src}->{dst} does not go forward between stages "
                                f"0..{schedule.num_stages - 1}")
    num_groups = [_check_rank(schedule, r, training) for r in range(schedule.num_ranks)]
    for stage_id in range(schedule.num_stages):
        _check_stage_order(schedule, stage_id, training)
    replay_nccl(schedule)
    return ValidationReport(schedule.num_ranks, schedule.num_microbatches, num_groups)
