"""Replay a schedule against a cost model: makespan, bubbles, in-flight activations.

The same replay proves a schedule executable (`merak.pipeline.validate`): sends are
non-blocking (as the interpreter's are), a receive blocks until every matching send was issued,
and a replay in which no stage can move while some have actions left is a deadlock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from merak.pipeline.actions import Action, ActionKind, Schedule

K = ActionKind
Edge = tuple[int, int]


class ScheduleError(ValueError):
    """A schedule that cannot run: unmatched communication, a deadlock, or a bad order."""


@dataclass(frozen=True)
class CostModel:
    """Per-stage durations in seconds (a scalar applies to every stage).

    Attributes:
        forward: forward time of one micro-batch.
        backward: backward time of one micro-batch.
        p2p: time from a send being issued to the data being available at the receiver.
        step: time of each per-step action (grad reductions, optimizer step).
    """

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    p2p: float = 0.0
    step: float = 0.0

    def _of(self, value: float | Sequence[float], stage_id: int) -> float:
        return float(value) if isinstance(value, (int, float)) else float(value[stage_id])

    def duration(self, stage_id: int, action: Action) -> float:
        if action.kind is K.FORWARD:
            return self._of(self.forward, stage_id)
        if action.kind is K.BACKWARD:
            return self._of(self.backward, stage_id)
        if action.kind in (K.REDUCE_TIED_GRADS, K.REDUCE_GRADS, K.OPTIMIZER_STEP):
            return self.step
        return 0.0


@dataclass(frozen=True)
class Event:
    stage_id: int
    action: Action
    start: float
    end: float


@dataclass
class SimulationResult:
    makespan: float
    busy: list[float]
    peak_activations: list[int]
    events: list[Event] = field(repr=False)

    @property
    def bubble_per_stage(self) -> list[float]:
        """Fraction of the makespan each stage spends not computing."""
        if self.makespan == 0:
            return [0.0] * len(self.busy)
        return [1.0 - b / self.makespan for b in self.busy]

    @property
    def bubble(self) -> float:
        """Mean bubble fraction over stages."""
        per_stage = self.bubble_per_stage
        return sum(per_stage) / len(per_stage)


def chain_edges(num_stages: int) -> frozenset[Edge]:
    return frozenset((s, s + 1) for s in range(num_stages - 1))


def _peers(edges: Iterable[Edge], num_stages: int) -> tuple[list[list[int]], list[list[int]]]:
    upstream: list[list[int]] = [[] for _ in range(num_stages)]
    downstream: list[list[int]] = [[] for _ in range(num_stages)]
    for src, dst in sorted(edges):
        if not (0 <= src < dst < num_stages):
            raise ScheduleError(f"edge {src}->{dst} does not go forward between stages "
                                f"0..{num_stages - 1}")
        upstream[dst].append(src)
        downstream[src].append(dst)
    return upstream, downstream


def replay(schedule: Schedule, costs: CostModel | None = None,
           edges: Iterable[Edge] | None = None) -> SimulationResult:
    """Execute `schedule` in simulated time.

    Args:
        schedule: one action list per stage.
        costs: durations; default forward 1, backward 2, no p2p or step time.
        edges: activation edges ``(src_stage, dst_stage)``; default the chain s -> s+1.
            Gradients flow along the same edges reversed.

    Raises:
        ScheduleError: a receive waits for a send that never comes, or the replay deadlocks.
    """
    costs = costs or CostModel()
    num_stages = len(schedule)
    upstream, downstream = _peers(chain_edges(num_stages) if edges is None else edges, num_stages)
    # message key (kind, src, dst, microbatch) -> arrival time
    arrivals: dict[tuple[str, int, int, int], float] = {}
    clock = [0.0] * num_stages
    busy = [0.0] * num_stages
    pointer = [0] * num_stages
    in_flight = [0] * num_stages
    peak = [0] * num_stages
    events: list[Event] = []

    def needed(stage_id: int, action: Action) -> list[tuple[str, int, int, int]]:
        mb = action.microbatch_id
        if action.kind is K.RECV_ACT:
            return [("act", src, stage_id, mb) for src in upstream[stage_id]]
        if action.kind is K.RECV_GRAD:
            return [("grad", dst, stage_id, mb) for dst in downstream[stage_id]]
        return []

    progress = True
    while progress:
        progress = False
        for s in range(num_stages):
            while pointer[s] < len(schedule[s]):
                action = schedule[s][pointer[s]]
                keys = needed(s, action)
                if any(key not in arrivals for key in keys):
                    break
                start = clock[s]
                end = max([start + costs.duration(s, action)] + [arrivals.pop(k) for k in keys])
                if action.kind is K.SEND_ACT:
                    for dst in downstream[s]:
                        arrivals[("act", s, dst, action.microbatch_id)] = end + costs.p2p
                elif action.kind is K.SEND_GRAD:
                    for src in upstream[s]:
                        arrivals[("grad", s, src, action.microbatch_id)] = end + costs.p2p
                elif action.kind is K.FORWARD:
                    in_flight[s] += 1
                    peak[s] = max(peak[s], in_flight[s])
                    busy[s] += end - start
                elif action.kind is K.BACKWARD:
                    in_flight[s] -= 1
                    busy[s] += end - start
                events.append(Event(s, action, start, end))
                clock[s] = end
                pointer[s] += 1
                progress = True
    stuck = [s for s in range(num_stages) if pointer[s] < len(schedule[s])]
    if stuck:
        waits = ", ".join(f"stage {s} at {schedule[s][pointer[s]]} (action #{pointer[s]})"
                          for s in stuck)
        raise ScheduleError(f"schedule deadlocks: no stage can proceed; blocked: {waits}")
    if arrivals:
        unmatched = ", ".join(f"{kind} {src}->{dst} micro-batch {mb}"
                              for kind, src, dst, mb in sorted(arrivals))
        raise ScheduleError(f"sends without a matching receive: {unmatched}")
    return SimulationResult(makespan=max(clock, default=0.0), busy=busy,
                            peak_activations=peak, events=events)


def simulate(schedule: Schedule, costs: CostModel | None = None,
             edges: Iterable[Edge] | None = None) -> SimulationResult:
    """Makespan, per-stage bubble fraction and peak in-flight activations of `schedule`."""
    return replay(schedule, costs, edges)
