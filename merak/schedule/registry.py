"""The schedule registry and `make_schedule`: a generator's block order, lowered to the
per-rank programs every tool reads.

Lowering places the communication the way NCCL needs it (`lower`): every abstract send and
receive becomes one action per peer stage of the split's edges, and the sends and receives a
rank meets between two of its computations are one posting group (one ``batch_isend_irecv``).
Between a forward and the next backward that puts a rank's send of activations and its receive
of output gradients in one group, and the neighbour's matching receive and send in one group of
its own: Megatron-LM's pairing, which keeps two ranks that each wait on the other from
deadlocking. Within a group, sends and receives are ordered by the message they carry, so on
every rank pair both sides post the messages of a channel in the same order (NCCL ignores tags).
`merak.schedule.validate` proves the result for every program.

Merak's schedules (TPDS 2023) move recomputation off 1F1B's critical path:
`pre_recompute_1f1b` reruns before the wait for the output gradient, `last_no_recompute_1f1b`
never recomputes on the last stage, `shifted_critical_path` does both. Merak also shifts the
first backwards of the last stages (extra warm-up forwards on stage p-2, a rerun before the
forward); a simulator search of those reorderings (every extra-warm-up vector within the memory
bound, p in 2..8, with and without p2p latency) found none that shortened the makespan, so
`shifted_critical_path` keeps 1F1B's order and in-flight bound. `zero_bubble` is ZB-H1 (Qi et
al., ICLR 2024); `interleaved_1f1b` is Megatron-LM's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from merak.schedule import generators as g
from merak.schedule.actions import (
    COMPUTE_KINDS,
    P2P_KINDS,
    SEND_KINDS,
    Action,
    ActionKind,
    Edge,
    Schedule,
    chain_edges,
)

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
        several_stages_per_rank: runs v >= 2 model chunks per rank (interleaved).
        summary: one line for `--help` and error messages.
    """

    name: str
    generator: Callable[..., list[list[Action]]]
    needs_recompute: bool = False
    splits_backward: bool = False
    several_stages_per_rank: bool = False
    summary: str = ""


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
                 summary="Megatron's interleaved 1F1B over v model chunks per rank"),
)}
"""Name -> `ScheduleInfo`."""


def schedule_info(name: str) -> ScheduleInfo:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown train_schedule {name!r}; choose one of "
                         f"{sorted(SCHEDULES)}") from None


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


def _message_order(action: Action) -> tuple:
    return (action.kind not in SEND_KINDS, action.message)


def _flush(program: list[Action], pending: list[Action], group: int) -> int:
    """Append the `pending` sends and receives to `program` as posting group `group`, ordered
    by message, and empty `pending`. Returns the next group number (`group` if none pended)."""
    if not pending:
        return group
    program.extend(Action(a.kind, a.stage_id, a.microbatch_id, a.peer, a.peer_stage, group)
                   for a in sorted(pending, key=_message_order))
    pending.clear()
    return group + 1


def lower(order: Sequence[Sequence[Action]], num_ranks: int, stages_per_rank: int,
          edges: Iterable[Edge], tail: Sequence[Action] = (),
          single_transfers: bool = False) -> tuple[tuple[Action, ...], ...]:
    """Per-rank programs from block orders: sends and receives expanded over `edges` (one
    action per peer stage), grouped between computations (or, with `single_transfers`, one
    transfer per group), ordered by message within a group, and `tail` appended to every
    rank."""
    upstream: dict[int, list[int]] = {}
    downstream: dict[int, list[int]] = {}
    for src, dst in sorted(edges):
        downstream.setdefault(src, []).append(dst)
        upstream.setdefault(dst, []).append(src)
    programs = []
    for actions in order:
        program: list[Action] = []
        pending: list[Action] = []  # this run of sends and receives
        group = 0
        for action in actions:
            if action.kind in P2P_KINDS:
                s = action.stage_id
                peers = upstream.get(s, []) if action.kind in (K.RECV_ACT, K.SEND_GRAD) \
                    else downstream.get(s, [])
                pending += [Action(action.kind, s, action.microbatch_id, peer % num_ranks, peer)
                            for peer in peers]
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
        group = _flush(program, pending, group)
        programs.append(tuple(program) + tuple(tail))
    return tuple(programs)


def make_schedule(name: str, num_stages: int, num_microbatches: int, *,
                  stages_per_rank: int = 1, recompute: Recompute = False,
                  edges: Iterable[Edge] | None = None) -> Schedule:
    """The programs of schedule `name` on `num_stages` pipeline ranks.

    Args:
        stages_per_rank: model chunks per rank (interleaved schedules; 1 for the others).
        recompute: which stages checkpoint activations (True: all; or one flag per stage, of
            ``num_stages * stages_per_rank``).
        edges: activation edges between stages; default the chain.

    Raises:
        ValueError: an unknown name, bad sizes, or a schedule that needs what is not given.
    """
    info = schedule_info(name)
    g.check_sizes(num_stages, num_microbatches)
    if not info.several_stages_per_rank and stages_per_rank != 1:
        raise ValueError(f"train_schedule {name!r} runs one stage per rank; num_model_chunks "
                         f"(--interleave) > 1 needs interleaved_1f1b")
    total = num_stages * stages_per_rank
    flags = recompute_flags(recompute, total)
    if info.needs_recompute and not any(flags):
        raise ValueError(f"train_schedule {name!r} reorders recomputation; turn on "
                         f"activation checkpointing (activation_checkpointing=True, or "
                         f"--recompute-cost in the simulator)")
    edges = chain_edges(total) if edges is None else frozenset(edges)
    order = info.generator(num_stages, num_microbatches, stages_per_rank, flags)
    return Schedule(name, num_stages, stages_per_rank, num_microbatches,
                    lower(order, num_stages, stages_per_rank, edges, step_tail()), edges)


def forward_schedule(num_stages: int, num_microbatches: int, *, stages_per_rank: int = 1,
                     edges: Iterable[Edge] | None = None,
                     single_transfers: bool = False) -> Schedule:
    """Forwards only (evaluation, activation measurement): no backward, no step tail. With
    `single_transfers` every transfer is a group of its own (the runtime's shape discovery,
    which must finish one message before it can size the next)."""
    g.check_sizes(num_stages, num_microbatches)
    total = num_stages * stages_per_rank
    edges = chain_edges(total) if edges is None else frozenset(edges)
    order = g.forward_only(num_stages, num_microbatches, stages_per_rank)
    return Schedule("forward", num_stages, stages_per_rank, num_microbatches,
                    lower(order, num_stages, stages_per_rank, edges,
                          single_transfers=single_transfers), edges)
