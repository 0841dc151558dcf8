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

from merak.schedule.actions import (
    COMPUTE_KINDS,
    RECV_KINDS,
    STEP_KINDS,
    Action,
    ActionKind,
    Schedule,
)
from merak.schedule.errors import ScheduleError
from merak.schedule.validate import validate_schedule

K = ActionKind
FREEING_KINDS = frozenset({K.BACKWARD, K.BACKWARD_WEIGHT})  # the last use of a micro-batch


def per_rank(value: float | Sequence[float], rank: int) -> float:
    return float(value) if isinstance(value, (int, float)) else float(value[rank])


@dataclass(frozen=True)
class CostModel:
    """Per-rank durations (a scalar applies to every rank). A rank hosting v stages spends
    1/v of them on each (its stages share its part of the model).

    Attributes:
        forward: forward time of one micro-batch.
        backward: backward time of one micro-batch (input and weight gradients).
        recompute: time to rerun the recomputed blocks (default: the forward time).
        weight_grad: the weight-gradient part of the backward, for schedules that split it
            (`backward_input` takes the rest); default half the backward.
        p2p: time from both sides of a transfer being posted to its completion.
        step: time of each per-step action (grad reductions, optimizer step).
        reference: time of a reference model's forward of one micro-batch
            (``reference_forward``, `merak.schedule.reference`); default the forward time.
    """

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    p2p: float = 0.0
    step: float = 0.0
    recompute: float | Sequence[float] | None = None
    weight_grad: float | Sequence[float] | None = None
    reference: float | Sequence[float] | None = None

    def duration(self, rank: int, action: Action) -> float:
        """Time of `action` on `rank` for a rank holding its whole share in one stage."""
        kind = action.kind
        if kind is K.FORWARD:
            return per_rank(self.forward, rank)
        if kind is K.BACKWARD:
            return per_rank(self.backward, rank)
        if kind is K.REFERENCE_FORWARD:
            return per_rank(self.forward if self.reference is None else self.reference, rank)
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
        kept: what it keeps when the stage recomputes that micro-batch (its recomputed
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
    """One posting group (one ``batch_isend_irecv``) of one rank, from posting to finish.

    Attributes:
        posted: the host time it was posted at.
        start: when it reaches the head of the rank's stream (None before).
        done: completion times of those of its transfers that met their partner.
        receives: whether it holds a receive (the host then waits for it).
    """

    def __init__(self, rank: int, actions: list[Action], posted: float):
        self.rank, self.actions, self.posted = rank, actions, posted
        self.start: float | None = None
        self.done: list[float] = []
        self.receives = any(a.kind in RECV_KINDS for a in actions)

    @property
    def end(self) -> float | None:
        """When its last transfer completed; None while any is unmatched."""
        return max(self.done, default=self.start) if len(self.done) == len(self.actions) \
            else None


Transfer = tuple[_Group, Action]


class _Simulation:
    """The state of one replay of `schedule`, advanced in rounds until nothing moves.

    Per rank the host runs its program in order on its own clock, posting each group of
    transfers onto the rank's stream; only the stream's head group is started, and its
    transfers queue on their (sender, receiver) channel, where they pair up in posting order.
    Memory is tracked per (stage, micro-batch) from its forward to the backward that frees it.
    """

    def __init__(self, schedule: Schedule, costs, memory: MemoryModel):
        num_ranks = schedule.num_ranks
        self.schedule, self.programs = schedule, schedule.programs
        self.costs, self.memory = costs, memory
        self.ranks = range(num_ranks)
        # a CostModel's durations are per rank, shared among the rank's stages
        self.share = 1.0 / schedule.stages_per_rank if isinstance(costs, CostModel) else 1.0
        self.recomputed = {(a.stage_id, a.microbatch_id) for program in self.programs
                           for a in program if a.kind is K.RECOMPUTE}
        # hosts
        self.clock = [0.0] * num_ranks
        self.busy = [0.0] * num_ranks
        self.pointer = [0] * num_ranks  # the next action of each program
        self.waiting: list[_Group | None] = [None] * num_ranks  # a receiving group
        # streams and channels
        self.streams: list[list[_Group]] = [[] for _ in self.ranks]  # posted, not finished
        self.last_end = [0.0] * num_ranks  # when each stream's last finished group ended
        self.channels: dict[tuple[int, int], tuple[list[Transfer], list[Transfer]]] = {}
        # memory
        self.in_flight = [0] * num_ranks
        self.peak_activations = [0] * num_ranks
        self.held: dict[tuple[int, int], float] = {}  # per (stage, micro-batch)
        self.live = [0.0] * num_ranks
        self.peak_memory = [0.0] * num_ranks
        self.events: list[Event] = []

    def run(self) -> SimulationResult:
        """Replay to the end; raise `ScheduleError` when some rank cannot finish."""
        while self._advance():
            pass
        stuck = [r for r in self.ranks
                 if self.pointer[r] < len(self.programs[r]) or self.streams[r]]
        if stuck:
            validate_schedule(self.schedule)  # names the deadlock
            raise ScheduleError(f"the replay stopped with ranks {stuck} unfinished")
        makespan = max(max(self.clock), max(self.last_end))
        self.events.sort(key=lambda e: (e.rank, e.start))
        return SimulationResult(makespan=makespan, busy=self.busy,
                                peak_activations=self.peak_activations, events=self.events,
                                peak_memory=self.peak_memory)

    def _advance(self) -> bool:
        """One round: every host runs as far as it can, queued transfers pair up, finished
        groups leave their streams. Returns whether anything moved."""
        moved = False
        for rank in self.ranks:
            moved |= self._run_host(rank)
        moved |= self._match()
        for rank in self.ranks:
            moved |= self._retire(rank)
        return moved

    def _run_host(self, rank: int) -> bool:
        """Run `rank`'s program until it waits for a receiving group or ends."""
        program = self.programs[rank]
        moved = False
        while self.waiting[rank] is None and self.pointer[rank] < len(program):
            action = program[self.pointer[rank]]
            if action.group is None:
                self._execute(rank, action)
                self.pointer[rank] += 1
            else:
                self._post(rank, action.group)
            moved = True
        return moved

    def _execute(self, rank: int, action: Action) -> None:
        """Run one host action (computation, load or per-step action) on `rank`'s clock."""
        scale = self.share if action.stage_id is not None else 1.0
        duration = self.costs.duration(rank, action) * scale
        start = self.clock[rank]
        self.clock[rank] = start + duration
        self.events.append(Event(rank, action, start, self.clock[rank]))
        if action.kind in COMPUTE_KINDS:
            self.busy[rank] += duration
            self._account_memory(rank, action)

    def _account_memory(self, rank: int, action: Action) -> None:
        """A forward holds activations, a recomputation adds back what the forward dropped,
        the micro-batch's last backward frees them; track the rank's peaks."""
        key = (action.stage_id, action.microbatch_id)
        kept, extra = self.memory.of(rank, action.stage_id, self.schedule.stages_per_rank,
                                     key in self.recomputed)
        if action.kind is K.FORWARD:
            self.in_flight[rank] += 1
            self.peak_activations[rank] = max(self.peak_activations[rank], self.in_flight[rank])
            self.held[key] = kept
            self.live[rank] += kept
        elif action.kind is K.RECOMPUTE:
            self.held[key] += extra
            self.live[rank] += extra
        elif action.kind in FREEING_KINDS:
            self.in_flight[rank] -= 1
            self.live[rank] -= self.held.pop(key)
        self.peak_memory[rank] = max(self.peak_memory[rank], self.live[rank])

    def _post(self, rank: int, group_id: int) -> None:
        """Post the run of actions of group `group_id` at `rank`'s pointer onto its stream;
        the host waits for a group that receives."""
        program, first = self.programs[rank], self.pointer[rank]
        end = first
        while end < len(program) and program[end].group == group_id:
            end += 1
        group = _Group(rank, list(program[first:end]), self.clock[rank])
        self.streams[rank].append(group)
        if len(self.streams[rank]) == 1:
            self._start_head(rank)
        if group.receives:
            self.waiting[rank] = group
        self.pointer[rank] = end

    def _start_head(self, rank: int) -> None:
        """Start the group at the head of `rank`'s stream: queue its transfers."""
        group = self.streams[rank][0]
        group.start = max(group.posted, self.last_end[rank])
        for action in group.actions:
            receives = action.kind in RECV_KINDS
            src, dst = (action.peer, rank) if receives else (rank, action.peer)
            sends, recvs = self.channels.setdefault((src, dst), ([], []))
            (recvs if receives else sends).append((group, action))

    def _match(self) -> bool:
        """Pair queued sends and receives on every channel in posting order; a transfer
        completes `p2p` after both sides' groups started. Returns whether any paired."""
        moved = False
        for sends, recvs in self.channels.values():
            while sends and recvs:
                (g1, a1), (g2, a2) = sends.pop(0), recvs.pop(0)
                if a1.message != a2.message:
                    raise ScheduleError(f"rank {g1.rank}'s {a1} would pair with rank "
                                        f"{g2.rank}'s {a2}")
                done = max(g1.start, g2.start) + self.costs.p2p
                for group, action in ((g1, a1), (g2, a2)):
                    group.done.append(done)
                    self.events.append(Event(group.rank, action, group.start, done))
                moved = True
        return moved

    def _retire(self, rank: int) -> bool:
        """Drop finished groups from the head of `rank`'s stream, release a host waiting for
        one, and start the next. Returns whether any finished."""
        stream = self.streams[rank]
        moved = False
        while stream and stream[0].end is not None:
            group = stream.pop(0)
            self.last_end[rank] = group.end
            if self.waiting[rank] is group:
                self.clock[rank] = max(self.clock[rank], group.end)
                self.waiting[rank] = None
            if stream:
                self._start_head(rank)
            moved = True
        return moved


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
    return _Simulation(schedule, costs or CostModel(), memory or MemoryModel()).run()
