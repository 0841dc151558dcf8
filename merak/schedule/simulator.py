"""Replay a schedule's programs against a cost model: makespan, bubbles, in-flight activations.

The replay follows NCCL's execution model, as the validator does: each rank's sends and
receives run group by group on one ordered stream; a group starts once the previous one has
finished, and each of its transfers completes when both sides' groups have started (plus the
p2p latency). A rank's host waits for a group that receives (the next computation needs its
data) and goes on past a group that only sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from merak.schedule.actions import COMPUTE_KINDS, RECV_KINDS, STEP_KINDS, Action, ActionKind, \
    Schedule

K = ActionKind
FREEING_KINDS = frozenset({K.BACKWARD, K.BACKWARD_WEIGHT})  # the last use of a micro-batch


class ScheduleError(ValueError):
    """A schedule that cannot run: unmatched communication, a deadlock, or a bad order."""


def per_rank(value: float | Sequence[float], rank: int) -> float:
    return float(value) if isinstance(value, (int, float)) else float(value[rank])


@dataclass(frozen=True)
class CostModel:
    """Per-rank durations (a scalar applies to every rank). A rank hosting v stages spends
    1/v of them on each (its stages share its part of the model).

    Attributes:
        forward: forward time of one micro-batch.
        backward: backward time of one micro-batch (input and weight gradients).
        recompute: time to rerun the checkpointed blocks (default: the forward time).
        weight_grad: the weight-gradient part of the backward, for schedules that split it
            (`backward_input` takes the rest); default half the backward.
        p2p: time from both sides of a transfer being posted to its completion.
        step: time of each per-step action (grad reductions, optimizer step).
    """

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    p2p: float = 0.0
    step: float = 0.0
    recompute: float | Sequence[float] | None = None
    weight_grad: float | Sequence[float] | None = None

    def duration(self, rank: int, action: Action) -> float:
        """Time of `action` on `rank` for a rank holding its whole share in one stage."""
        kind = action.kind
        if kind is K.FORWARD:
            return per_rank(self.forward, rank)
        if kind is K.BACKWARD:
            return per_rank(self.backward, rank)
        if kind is K.RECOMPUTE:
            return per_rank(self.forward if self.recompute is None else self.recompute, rank)
        if kind in (K.BACKWARD_INPUT, K.BACKWARD_WEIGHT):
            backward = per_rank(self.backward, rank)
            weight = backward / 2 if self.weight_grad is None else per_rank(self.weight_grad,
                                                                            rank)
            return weight if kind is K.BACKWARD_WEIGHT else backward - weight
        if kind in STEP_KINDS:
            return self.step
        return 0.0


@dataclass(frozen=True)
class MemoryModel:
    """Activation memory of one micro-batch (any unit; a scalar applies to all): per rank, a
    rank hosting v stages keeping 1/v on each; or, with `per_stage`, one value per stage.

    Attributes:
        full: what a forward keeps for backward without recomputation.
        kept: what it keeps when the stage recomputes that micro-batch (its checkpointed
            blocks keep only their inputs); the `recompute` action adds back ``full - kept``
            until the backward frees it all. Default: `full` (nothing saved).
        per_stage: `full` and `kept` are indexed by stage (measured), not by rank.
    """

    full: float | Sequence[float] = 1.0
    kept: float | Sequence[float] | None = None
    per_stage: bool = False

    def of(self, rank: int, stage_id: int, stages_per_rank: int,
           recomputed: bool) -> tuple[float, float]:
        """(what a forward of `stage_id` keeps, what its recomputation adds)."""
        index, share = (stage_id, 1.0) if self.per_stage else (rank, 1.0 / stages_per_rank)
        full = per_rank(self.full, index) * share
        if not recomputed or self.kept is None:
            return full, 0.0
        kept = per_rank(self.kept, index) * share
        return kept, full - kept


@dataclass(frozen=True)
class Event:
    """`rank` is the timeline row; `action.stage_id` the stage whose action it is."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimulationResult:
    """Per rank: busy time, most micro-batches in flight (forward done, memory not yet freed by
    its backward) and most activation memory (`MemoryModel` units)."""

    makespan: float
    busy: list[float]
    peak_activations: list[int]
    events: list[Event] = field(repr=False)
    peak_memory: list[float] = field(default_factory=list)

    @property
    def idle_per_stage(self) -> list[float]:
        """Time each rank spends not computing (the bubble, in time units)."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_per_stage(self) -> list[float]:
        """Fraction of the makespan each rank spends not computing."""
        if self.makespan == 0:
            return [0.0] * len(self.busy)
        return [1.0 - b / self.makespan for b in self.busy]

    @property
    def bubble(self) -> float:
        per_stage = self.bubble_per_stage
        return sum(per_stage) / len(per_stage)


class _Group:
    def __init__(self, rank: int, actions: list[Action], posted: float):
        self.rank, self.actions, self.posted = rank, actions, posted
        self.start: float | None = None
        self.done: list[float] = []
        self.receives = any(a.kind in RECV_KINDS for a in actions)

    @property
    def end(self) -> float | None:
        return max(self.done, default=self.start) if len(self.done) == len(self.actions) \
            else None


def simulate(schedule: Schedule, costs=None, memory: MemoryModel | None = None
             ) -> SimulationResult:
    """Makespan, per-rank busy time, peak in-flight activations and memory of `schedule`.

    Args:
        costs: a `CostModel` (per rank), or any object with ``duration(rank, action)`` and a
            ``p2p`` attribute giving each action's own time (no 1/v share applied).
        memory: activation memory per micro-batch; default 1 per rank.

    Raises:
        ScheduleError: the replay cannot finish (see `merak.schedule.validate` for the reason).
    """
    costs = costs or CostModel()
    memory = memory or MemoryModel()
    p, v = schedule.num_ranks, schedule.stages_per_rank
    share = 1.0 / v if isinstance(costs, CostModel) else 1.0
    programs = schedule.programs
    recomputed = {(a.stage_id, a.microbatch_id) for prog in programs for a in prog
                  if a.kind is K.RECOMPUTE}
    clock, busy = [0.0] * p, [0.0] * p
    pointer = [0] * p
    streams: list[list[_Group]] = [[] for _ in range(p)]  # posted, not yet finished
    last_end = [0.0] * p
    waiting: list[_Group | None] = [None] * p  # a receiving group the host waits for
    channels: dict[tuple[int, int], tuple[list, list]] = {}
    in_flight, peak = [0] * p, [0] * p
    held: dict[tuple[int, int], float] = {}
    live, peak_memory = [0.0] * p, [0.0] * p
    events: list[Event] = []

    def activate(rank: int) -> None:
        group = streams[rank][0]
        group.start = max(group.posted, last_end[rank])
        for action in group.actions:
            src, dst = (rank, action.peer) if action.kind not in RECV_KINDS else \
                (action.peer, rank)
            sends, recvs = channels.setdefault((src, dst), ([], []))
            (recvs if action.kind in RECV_KINDS else sends).append((group, action))

    def match() -> bool:
        moved = False
        for sends, recvs in channels.values():
            while sends and recvs:
                (g1, a1), (g2, a2) = sends.pop(0), recvs.pop(0)
                if a1.message != a2.message:
                    raise ScheduleError(f"rank {g1.rank}'s {a1} would pair with rank "
                                        f"{g2.rank}'s {a2}")
                done = max(g1.start, g2.start) + costs.p2p
                for group, action in ((g1, a1), (g2, a2)):
                    group.done.append(done)
                    events.append(Event(group.rank, action, group.start, done))
                moved = True
        return moved

    def retire(rank: int) -> bool:
        moved = False
        while streams[rank] and streams[rank][0].end is not None:
            group = streams[rank].pop(0)
            last_end[rank] = group.end
            if waiting[rank] is group:
                clock[rank] = max(clock[rank], group.end)
                waiting[rank] = None
            if streams[rank]:
                activate(rank)
            moved = True
        return moved

    def run_host(rank: int) -> bool:
        moved = False
        program = programs[rank]
        while waiting[rank] is None and pointer[rank] < len(program):
            action = program[pointer[rank]]
            if action.group is not None:
                end = pointer[rank]
                while end < len(program) and program[end].group == action.group:
                    end += 1
                group = _Group(rank, list(program[pointer[rank]:end]), clock[rank])
                streams[rank].append(group)
                if len(streams[rank]) == 1:
                    activate(rank)
                if group.receives:
                    waiting[rank] = group
                pointer[rank] = end
                moved = True
                continue
            duration = costs.duration(rank, action) * (share if action.stage_id is not None
                                                        else 1.0)
            start = clock[rank]
            clock[rank] = start + duration
            events.append(Event(rank, action, start, clock[rank]))
            if action.kind in COMPUTE_KINDS:
                busy[rank] += duration
                key = (action.stage_id, action.microbatch_id)
                kept, extra = memory.of(rank, action.stage_id, v, key in recomputed)
                if action.kind is K.FORWARD:
                    in_flight[rank] += 1
                    peak[rank] = max(peak[rank], in_flight[rank])
                    held[key] = kept
                    live[rank] += kept
                elif action.kind is K.RECOMPUTE:
                    held[key] += extra
                    live[rank] += extra
                elif action.kind in FREEING_KINDS:
                    in_flight[rank] -= 1
                    live[rank] -= held.pop(key)
                peak_memory[rank] = max(peak_memory[rank], live[rank])
            pointer[rank] += 1
            moved = True
        return moved

    progress = True
    while progress:
        progress = False
        for rank in range(p):
            progress |= run_host(rank)
        progress |= match()
        for rank in range(p):
            progress |= retire(rank)
    stuck = [r for r in range(p) if pointer[r] < len(programs[r]) or streams[r]]
    if stuck:
        from merak.schedule.validate import validate_schedule

        validate_schedule(schedule)  # names the deadlock
        raise ScheduleError(f"the replay stopped with ranks {stuck} unfinished")
    makespan = max(max(clock), max(last_end))
    events.sort(key=lambda e: (e.rank, e.start))
    return SimulationResult(makespan=makespan, busy=busy, peak_activations=peak, events=events,
                            peak_memory=peak_memory)
