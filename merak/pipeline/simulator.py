"""Replay a schedule against a cost model: makespan, bubbles, in-flight activations.

The same replay proves a schedule executable (`merak.pipeline.validate`): sends are
non-blocking (as the interpreter's are), a receive blocks until every matching send was issued,
and a replay in which no stage can move while some have actions left is a deadlock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from merak.pipeline.actions import COMPUTE_KINDS, Action, ActionKind, Schedule

K = ActionKind
FREEING_KINDS = frozenset({K.BACKWARD, K.BACKWARD_WEIGHT})  # the last use of a micro-batch
Edge = tuple[int, int]


class ScheduleError(ValueError):
    """A schedule that cannot run: unmatched communication, a deadlock, or a bad order."""


def _per_stage(value: float | Sequence[float], stage_id: int) -> float:
    return float(value) if isinstance(value, (int, float)) else float(value[stage_id])


@dataclass(frozen=True)
class CostModel:
    """Per-stage durations in seconds (a scalar applies to every stage).

    Attributes:
        forward: forward time of one micro-batch.
        backward: backward time of one micro-batch (input and weight gradients).
        recompute: time to rerun the checkpointed blocks (default: the forward time).
        weight_grad: the weight-gradient part of the backward, for schedules that split it
            (`backward_input` takes the rest); default half the backward.
        p2p: time from a send being issued to the data being available at the receiver.
        step: time of each per-step action (grad reductions, optimizer step).
    """

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    p2p: float = 0.0
    step: float = 0.0
    recompute: float | Sequence[float] | None = None
    weight_grad: float | Sequence[float] | None = None

    def duration(self, stage_id: int, action: Action) -> float:
        kind = action.kind
        if kind is K.FORWARD:
            return _per_stage(self.forward, stage_id)
        if kind is K.BACKWARD:
            return _per_stage(self.backward, stage_id)
        if kind is K.RECOMPUTE:
            return _per_stage(self.forward if self.recompute is None else self.recompute, stage_id)
        if kind in (K.BACKWARD_INPUT, K.BACKWARD_WEIGHT):
            backward = _per_stage(self.backward, stage_id)
            weight = backward / 2 if self.weight_grad is None else _per_stage(self.weight_grad,
                                                                             stage_id)
            return weight if kind is K.BACKWARD_WEIGHT else backward - weight
        if kind in (K.REDUCE_TIED_GRADS, K.REDUCE_GRADS, K.OPTIMIZER_STEP):
            return self.step
        return 0.0


@dataclass(frozen=True)
class MemoryModel:
    """Activation memory of one micro-batch per stage (any unit; a scalar applies to all).

    Attributes:
        full: what a forward keeps for backward without recomputation.
        kept: what it keeps when the stage recomputes that micro-batch (its checkpointed
            blocks keep only their inputs); the `recompute` action adds back ``full - kept``
            until the backward frees it all. Default: `full` (nothing saved).
    """

    full: float | Sequence[float] = 1.0
    kept: float | Sequence[float] | None = None

    def of(self, stage_id: int, recomputed: bool) -> tuple[float, float]:
        """(bytes the forward keeps, bytes the recomputation adds) on `stage_id`."""
        full = _per_stage(self.full, stage_id)
        if not recomputed or self.kept is None:
            return full, 0.0
        kept = _per_stage(self.kept, stage_id)
        return kept, full - kept


@dataclass(frozen=True)
class Event:
    """`stage_id` is the device's row (the stage, or the rank of an interleaved schedule);
    `virtual_stage` the stage whose action it is (None for per-step actions)."""

    stage_id: int
    action: Action
    start: float
    end: float
    virtual_stage: int | None = None


@dataclass
class SimulationResult:
    """`peak_activations`: most micro-batches in flight per stage (forward done, memory not yet
    freed by its backward); `peak_memory`: the most activation memory per stage
    (`MemoryModel` units)."""

    makespan: float
    busy: list[float]
    peak_activations: list[int]
    events: list[Event] = field(repr=False)
    peak_memory: list[float] = field(default_factory=list)

    @property
    def idle_per_stage(self) -> list[float]:
        """Time each stage spends not computing (the bubble, in time units)."""
        return [self.makespan - b for b in self.busy]

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
           edges: Iterable[Edge] | None = None,
           memory: MemoryModel | None = None) -> SimulationResult:
    """Execute `schedule` in simulated time.

    Args:
        schedule: one action list per stage.
        costs: durations; default forward 1, backward 2, no p2p or step time.
        edges: activation edges ``(src_stage, dst_stage)``; default the chain s -> s+1.
            Gradients flow along the same edges reversed.
        memory: activation memory per micro-batch; default 1 (then `peak_memory` equals
            `peak_activations`).

    Raises:
        ScheduleError: a receive waits for a send that never comes, or the replay deadlocks.
    """
    programs = [[(s, a) for a in actions] for s, actions in enumerate(schedule)]
    return replay_programs(programs, len(schedule), costs, edges, memory)


Program = Sequence[tuple[int | None, Action]]
"""What one device runs: ``(stage_id, action)`` pairs in order; None marks a per-step action."""


def replay_programs(programs: Sequence[Program], num_stages: int,
                    costs: CostModel | None = None, edges: Iterable[Edge] | None = None,
                    memory: MemoryModel | None = None) -> SimulationResult:
    """`replay` for devices that each run the actions of one or more stages, serialized in the
    order of their program (interleaved schedules: a rank hosts several virtual stages). Costs,
    memories and edges are per stage; busy time, idle time and peaks are per device."""
    costs = costs or CostModel()
    num_lanes = len(programs)
    upstream, downstream = _peers(chain_edges(num_stages) if edges is None else edges, num_stages)
    # message key (kind, src, dst, microbatch) -> arrival time
    arrivals: dict[tuple[str, int, int, int], float] = {}
    clock = [0.0] * num_lanes
    busy = [0.0] * num_lanes
    pointer = [0] * num_lanes
    in_flight = [0] * num_lanes
    peak = [0] * num_lanes
    memory = memory or MemoryModel()
    recomputed = {(s, a.microbatch_id) for program in programs for s, a in program
                  if a.kind is K.RECOMPUTE}
    held: dict[tuple[int, int], float] = {}
    live = [0.0] * num_lanes
    peak_memory = [0.0] * num_lanes
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
        for lane in range(num_lanes):
            while pointer[lane] < len(programs[lane]):
                s, action = programs[lane][pointer[lane]]
                s = lane if s is None else s
                keys = needed(s, action)
                if any(key not in arrivals for key in keys):
                    break
                start = clock[lane]
                end = max([start + costs.duration(s, action)] + [arrivals.pop(k) for k in keys])
                if action.kind is K.SEND_ACT:
                    for dst in downstream[s]:
                        arrivals[("act", s, dst, action.microbatch_id)] = end + costs.p2p
                elif action.kind is K.SEND_GRAD:
                    for src in upstream[s]:
                        arrivals[("grad", s, src, action.microbatch_id)] = end + costs.p2p
                elif action.kind in COMPUTE_KINDS:
                    busy[lane] += end - start
                    key = (s, action.microbatch_id)
                    kept, extra = memory.of(s, key in recomputed)
                    if action.kind is K.FORWARD:
                        in_flight[lane] += 1
                        peak[lane] = max(peak[lane], in_flight[lane])
                        held[key] = kept
                        live[lane] += kept
                    elif action.kind is K.RECOMPUTE:
                        held[key] += extra
                        live[lane] += extra
                    elif action.kind in FREEING_KINDS:
                        in_flight[lane] -= 1
                        live[lane] -= held.pop(key)
                    peak_memory[lane] = max(peak_memory[lane], live[lane])
                events.append(Event(lane, action, start, end, s))
                clock[lane] = end
                pointer[lane] += 1
                progress = True
    stuck = [lane for lane in range(num_lanes) if pointer[lane] < len(programs[lane])]
    if stuck:
        waits = ", ".join(_where(lane, num_lanes, num_stages, programs[lane], pointer[lane])
                          for lane in stuck)
        raise ScheduleError(f"schedule deadlocks: no stage can proceed; blocked: {waits}")
    if arrivals:
        unmatched = ", ".join(f"{kind} {src}->{dst} micro-batch {mb}"
                              for kind, src, dst, mb in sorted(arrivals))
        raise ScheduleError(f"sends without a matching receive: {unmatched}")
    return SimulationResult(makespan=max(clock, default=0.0), busy=busy,
                            peak_activations=peak, events=events, peak_memory=peak_memory)


def _where(lane: int, num_lanes: int, num_stages: int, program: Program, index: int) -> str:
    stage_id, action = program[index]
    if num_lanes == num_stages:
        return f"stage {lane} at {action} (action #{index})"
    return f"rank {lane} at {action} of virtual stage {stage_id} (action #{index})"


def simulate(schedule: Schedule, costs: CostModel | None = None,
             edges: Iterable[Edge] | None = None,
             memory: MemoryModel | None = None) -> SimulationResult:
    """Makespan, per-stage bubble, peak in-flight activations and memory of `schedule`."""
    return replay(schedule, costs, edges, memory)
