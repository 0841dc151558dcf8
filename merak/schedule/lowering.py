"""Lowering: a generator's block order becomes the per-rank programs every tool reads.

`lower` places the communication the way NCCL needs it. Every abstract send and receive becomes
one action per peer stage of the split's edges, addressed to the peer stage's rank in the
schedule's placement; the sends and receives a rank meets between two of its computations are one
posting group (one ``batch_isend_irecv``). Between a forward and the next backward that puts a
rank's send of activations and its receive of output gradients in one group, and the
neighbour's matching receive and send in one group of its own: Megatron-LM's pairing, which
keeps two ranks that each wait on the other from deadlocking. Within a group, sends and
receives are ordered by the message they carry.

A transfer between two stages of one rank (the turn of a V-shaped placement) is a local
hand-off: it stays in the program where the order put it, outside every group (a rank cannot
send to itself; the interpreter passes the values over in memory).

NCCL ignores tags, so on every rank pair both sides must post the messages of a channel (one
sender, one receiver) in the same order. Where a rank would receive a channel's messages in
another order than its peer sends them (interleaved 1F1B with micro-batch groups longer than
p, or a last group shorter than the others; V-shaped schedules whose two stages per rank
share a channel), `follow_senders` moves the receives that arrive earlier into the group of
the first one the rank waits for: the rank takes the messages as they come, as Megatron's
interleaved schedule does, and keeps them until their computation. `merak.schedule.validate`
proves the result for every program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from merak.schedule.actions import (
    COMPUTE_KINDS,
    P2P_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    Action,
    ActionKind,
    Edge,
    Placement,
    Program,
)

K = ActionKind


def _message_order(action: Action) -> tuple:
    return (action.kind not in SEND_KINDS, action.message)


def _flush(program: list[Action], pending: list[Action], group: int) -> int:
    """Append the `pending` sends and receives to `program` as posting group `group`, ordered
    by message, and empty `pending`. Returns the next group number (`group` if none pended)."""
    if not pending:
        return group
    program.extend(dataclasses.replace(a, group=group)
                   for a in sorted(pending, key=_message_order))
    pending.clear()
    return group + 1


def lower(order: Sequence[Sequence[Action]], placement: Placement, edges: Iterable[Edge],
          tail: Sequence[Action] = (), single_transfers: bool = False) -> tuple[Program, ...]:
    """Per-rank programs from block orders (one per rank): sends and receives expanded over
    `edges` (one action per peer stage, addressed to its rank in `placement`; local hand-offs
    between two stages of one rank outside any group), grouped between computations (or, with
    `single_transfers`, one transfer per group), ordered by message within a group, each
    channel received in its send order (`follow_senders`), and `tail` appended to every
    rank."""
    upstream: dict[int, list[int]] = {}
    downstream: dict[int, list[int]] = {}
    for src, dst in sorted(edges):
        downstream.setdefault(src, []).append(dst)
        upstream.setdefault(dst, []).append(src)
    programs = []
    for rank, actions in enumerate(order):
        program: list[Action] = []
        pending: list[Action] = []  # this run of sends and receives
        group = 0
        for action in actions:
            if action.kind in P2P_KINDS:
                s = action.stage_id
                peers = upstream.get(s, []) if action.kind in (K.RECV_ACT, K.SEND_GRAD) \
                    else downstream.get(s, [])
                for peer in peers:
                    transfer = Action(action.kind, s, action.microbatch_id, placement[peer],
                                      peer)
                    (program if placement[peer] == rank else pending).append(transfer)
                if single_transfers:
                    for transfer in pending[:-1]:
                        program.append(dataclasses.replace(transfer, group=group))
                        group += 1
                    del pending[:-1]
                    group = _flush(program, pending, group)
            elif action.kind in COMPUTE_KINDS:
                group = _flush(program, pending, group)
                program.append(action)
            else:
                program.append(action)  # a load does not end a group: it needs no peer
        _flush(program, pending, group)
        programs.append(program)
    return tuple(tuple(p) + tuple(tail) for p in follow_senders(programs))


def follow_senders(programs: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """The programs with every channel received in the order its sender posts it: a group
    that receives a channel's message also receives that channel's earlier messages not yet
    received (moved from their later groups), in send order. Programs that already agree are
    returned unchanged; groups are renumbered in program order."""
    sent: dict[tuple[int, int], dict[tuple, int]] = {}  # (src, dst) -> message -> position
    for rank, program in enumerate(programs):
        for action in program:
            if action.kind in SEND_KINDS and not action.local:
                channel = sent.setdefault((rank, action.peer), {})
                channel[action.message] = len(channel)
    result = []
    for rank, program in enumerate(programs):
        receives = {}  # (peer, position) -> the receive action
        for action in program:
            if action.kind in RECV_KINDS and not action.local:
                receives[(action.peer, sent[(action.peer, rank)][action.message])] = action
        taken: set[Action] = set()
        taken_up_to: dict[int, int] = {}  # peer -> the channel's positions received so far
        out: list[Action] = []
        index = number = 0
        while index < len(program):
            action = program[index]
            if action.group is None:
                out.append(action)
                index += 1
                continue
            end = index
            while end < len(program) and program[end].group == action.group:
                end += 1
            group = [a for a in program[index:end] if a not in taken]
            index = end
            latest: dict[int, int] = {}
            for a in group:
                if a.kind in RECV_KINDS:
                    position = sent[(a.peer, rank)][a.message]
                    latest[a.peer] = max(latest.get(a.peer, -1), position)
            slots = {peer: [] for peer in latest}  # the channel's receives, in send order
            for peer, last in latest.items():
                for position in range(taken_up_to.get(peer, 0), last + 1):
                    slots[peer].append(receives[(peer, position)])
                taken_up_to[peer] = last + 1
            taken.update(a for channel in slots.values() for a in channel)
            pulled = [a for channel in slots.values() for a in channel if a not in group]
            rebuilt = []
            for a in sorted(group + pulled, key=_message_order):
                rebuilt.append(slots[a.peer].pop(0) if a.kind in RECV_KINDS else a)
            if rebuilt:
                out.extend(dataclasses.replace(a, group=number) for a in rebuilt)
                number += 1
        result.append(out)
    return result
