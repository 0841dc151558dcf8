"""Receives placed where their message arrives, from a unit-time plan of the compute order.

A generator decides each rank's order of computations; where a rank posts each receive decides
whether NCCL's rules (one ordered stream per rank, rendezvous sends, messages paired in posting
order) can run it. Posting a receive right before the computation that needs it works for 1F1B
and its relatives, but not for orders in which a rank computes something else between a
message's arrival and its use: interleaved 1F1B with micro-batch groups of other sizes than p,
ZB-V, DualPipeV. Their ranks would wait on each other's later groups.

`receive_on_arrival` plans the order first: every rank runs its computations in order, each as
early as its inputs allow, with unit times (forward 1, backward 2, each half of a split
backward 1, recomputation 1) and free communication. Each receive then moves to the boundary
(between two computations of its rank) at which its message has arrived in that plan; sends stay
right after the computation that produced them. Lowered (one posting group per boundary), the
programs cannot deadlock: the unfinished group of the earliest plan time always completes,
because what it receives was sent at or before that time and what it sends is received at the
receiver's first boundary at or after it, which is then the receiver's current group. The
validator still proves every program. Computations written next to each other without a send or
receive between them form one unit (a steady-state pair of interleaved 1F1B, DualPipeV's
forward-and-backward pairs): they start together, so their receives come before both and
their sends after both.
"""

from __future__ import annotations

from collections.abc import Sequence

from merak.schedule.actions import COMPUTE_KINDS, P2P_KINDS, RECV_KINDS, Action, ActionKind

K = ActionKind
UNIT_TIMES = {K.FORWARD: 1.0, K.BACKWARD: 2.0, K.BACKWARD_INPUT: 1.0, K.BACKWARD_WEIGHT: 1.0,
              K.RECOMPUTE: 1.0}
GRAD_KINDS = (K.BACKWARD, K.BACKWARD_INPUT)  # the computations that make input gradients


def compute_units(actions: Sequence[Action]) -> list[list[int]]:
    """Indices of each unit's computations: computations with no send or receive between
    them."""
    units: list[list[int]] = []
    open_unit = False
    for index, action in enumerate(actions):
        if action.kind in P2P_KINDS:
            open_unit = False
        elif action.kind in COMPUTE_KINDS:
            if not open_unit:
                units.append([])
                open_unit = True
            units[-1].append(index)
    return units


def _needs(action: Action, num_stages: int) -> tuple | None:
    """The computation elsewhere whose output `action` needs (a chain neighbour's), as
    ``(is_forward, stage, microbatch)``."""
    s, mb = action.stage_id, action.microbatch_id
    if action.kind is K.FORWARD and s > 0:
        return True, s - 1, mb
    if action.kind in GRAD_KINDS and s < num_stages - 1:
        return False, s + 1, mb
    return None


def plan(order: Sequence[Sequence[Action]], num_stages: int
         ) -> tuple[list[list[tuple[float, float]]], dict[tuple, float]]:
    """Per rank, ``(start, end)`` of each unit of `order` run as early as its inputs allow
    (`UNIT_TIMES`), and the end of each forward and input-gradient computation, keyed
    ``(is_forward, stage, microbatch)``.

    Raises:
        ValueError: the order cannot run: some rank waits for a computation that waits for it.
    """
    units = [compute_units(actions) for actions in order]
    times: list[list[tuple[float, float]]] = [[] for _ in order]
    done: dict[tuple, float] = {}
    clock = [0.0] * len(order)
    moved = True
    while moved:
        moved = False
        for rank, actions in enumerate(order):
            while len(times[rank]) < len(units[rank]):
                unit = [actions[i] for i in units[rank][len(times[rank])]]
                needs = [n for a in unit if (n := _needs(a, num_stages)) is not None
                         and n not in {(a2.kind is K.FORWARD, a2.stage_id, a2.microbatch_id)
                                       for a2 in unit}]
                if any(n not in done for n in needs):
                    break
                start = max([clock[rank], *(done[n] for n in needs)])
                end = start + sum(UNIT_TIMES[a.kind] for a in unit)
                for a in unit:  # its outputs leave when the unit ends (its sends follow it)
                    if a.kind is K.FORWARD or a.kind in GRAD_KINDS:
                        done[(a.kind is K.FORWARD, a.stage_id, a.microbatch_id)] = end
                times[rank].append((start, end))
                clock[rank] = end
                moved = True
    stuck = [r for r in range(len(order)) if len(times[r]) < len(units[r])]
    if stuck:
        waits = []
        for r in stuck:
            unit = [order[r][i] for i in units[r][len(times[r])]]
            waits.append(f"rank {r} at {' '.join(map(str, unit))}")
        raise ValueError("the computation order cannot run (each waits for the other): "
                         + "; ".join(waits))
    return times, done


def receive_on_arrival(order: Sequence[Sequence[Action]], num_stages: int
                       ) -> list[list[Action]]:
    """`order` with every receive moved to the first boundary of its rank at or after its
    message's arrival in the unit-time `plan` (see the module docstring)."""
    times, done = plan(order, num_stages)
    result = []
    for rank, actions in enumerate(order):
        units = compute_units(actions)
        first = {indices[0]: u for u, indices in enumerate(units)}
        starts = [start for start, _ in times[rank]]
        at_unit: dict[int, list[tuple[float, int, Action]]] = {}
        kept: list[Action | None] = []
        for index, action in enumerate(actions):
            if action.kind in RECV_KINDS:
                forward = action.kind is K.RECV_ACT
                source = (forward, action.stage_id - 1 if forward else action.stage_id + 1,
                          action.microbatch_id)
                if source in done:
                    arrival = done[source]
                    unit = next(u for u, start in enumerate(starts) if start >= arrival)
                    at_unit.setdefault(unit, []).append((arrival, index, action))
                    kept.append(None)
                    continue
            kept.append(action)
        out: list[Action] = []
        for index, action in enumerate(kept):
            if index in first:
                out += [a for _, _, a in sorted(at_unit.get(first[index], []),
                                                key=lambda t: t[:2])]
            if action is not None:
                out.append(action)
        result.append(out)
    return result
