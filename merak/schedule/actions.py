"""The schedule vocabulary: one instruction of one pipeline rank, and a whole schedule.

A schedule is, per pipeline rank, an ordered program of `Action`s over the rank's stages (one
stage per rank for GPipe, 1F1B and Merak's schedules; several for interleaved 1F1B, ZB-V and
DualPipeV). Which rank holds which stage is the schedule's `placement`, data like the rest:
`round_robin` (virtual stage k on rank ``k % num_ranks``, Megatron's) or `v_shape` (ZB-V's and
DualPipeV's: stages 0..p-1 down the ranks, p..2p-1 back up, so rank r holds r and 2p-1-r).
Communication is explicit: every send and receive names its peer rank and stage, and the actions
a rank posts together in one ``batch_isend_irecv`` share a `group` number. A send or receive
between two stages of one rank (the turn of a V) has no group: it is a local hand-off that no
process group sees (`Action.local`). The interpreter executes the programs, the validator
proves them runnable under NCCL's point-to-point rules, the simulator times them, the timeline
draws them and the clock frontier plans clocks over them: all read this one object.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass


class ActionKind(str, enum.Enum):
    """Kinds of pipeline instructions. The value is the instruction name hooks receive."""

    LOAD = "load"                              # read this stage's inputs of a micro-batch
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"                    # rerun the recomputed blocks before the backward
    BACKWARD_INPUT = "backward_input"          # zero-bubble: input gradients only (sent on)
    BACKWARD_WEIGHT = "backward_weight"        # zero-bubble: the weight gradients, later
    SEND_ACT = "send_act"                      # activations to one downstream stage
    RECV_ACT = "recv_act"                      # activations from one upstream stage
    SEND_GRAD = "send_grad"                    # input gradients to one upstream stage
    RECV_GRAD = "recv_grad"                    # output gradients from one downstream stage
    REDUCE_TIED_GRADS = "reduce_tied_grads"    # sum grads of weights tied across ranks
    REDUCE_GRADS = "reduce_grads"              # data-parallel gradient all-reduce
    OPTIMIZER_STEP = "optimizer_step"
    # the reference model's forward of a micro-batch (TRL's DPO, KTO): no gradients, nothing
    # kept for a backward (`merak.schedule.reference`)
    REFERENCE_FORWARD = "reference_forward"

    def __str__(self) -> str:
        return self.value


K = ActionKind
BACKWARD_KINDS = frozenset({K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT})
COMPUTE_KINDS = frozenset({K.FORWARD, K.RECOMPUTE, K.REFERENCE_FORWARD}) | BACKWARD_KINDS
SEND_KINDS = frozenset({K.SEND_ACT, K.SEND_GRAD})
RECV_KINDS = frozenset({K.RECV_ACT, K.RECV_GRAD})
P2P_KINDS = SEND_KINDS | RECV_KINDS
STEP_KINDS = frozenset({K.REDUCE_TIED_GRADS, K.REDUCE_GRADS, K.OPTIMIZER_STEP})


@dataclass(frozen=True)
class Action:
    """One instruction of one rank.

    Attributes:
        kind: what to do.
        stage_id: the (virtual) stage it belongs to; None for the per-step actions.
        microbatch_id: the micro-batch; None for the per-step actions.
        peer: for a send or receive, the pipeline rank on the other side.
        peer_stage: for a send or receive, the stage on the other side.
        group: for a send or receive, its posting group: the actions of one rank with the same
            group are posted together (one ``batch_isend_irecv``), groups in program order.
    """

    kind: ActionKind
    stage_id: int | None = None
    microbatch_id: int | None = None
    peer: int | None = None
    peer_stage: int | None = None
    group: int | None = None

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def local(self) -> bool:
        """In a lowered program: a hand-off between two stages of this rank (a send or receive
        outside any posting group)."""
        return self.kind in P2P_KINDS and self.group is None

    @property
    def message(self) -> tuple[str, int, int, int] | None:
        """What a send or receive carries: ``("act" | "grad", src_stage, dst_stage, mb)`` with
        (src, dst) the activation's edge, the same tuple on both sides of the transfer (None for
        other actions)."""
        if self.kind in (K.SEND_ACT, K.RECV_GRAD):
            src, dst = self.stage_id, self.peer_stage
        elif self.kind in (K.RECV_ACT, K.SEND_GRAD):
            src, dst = self.peer_stage, self.stage_id
        else:
            return None
        what = "act" if self.kind in (K.SEND_ACT, K.RECV_ACT) else "grad"
        return what, src, dst, self.microbatch_id  # (src, dst): the activation's edge

    def __str__(self) -> str:
        if self.microbatch_id is None:
            return self.name
        text = f"{self.name}[{self.microbatch_id}]@{self.stage_id}"
        if self.peer_stage is not None:
            text += f"{'->' if self.kind in SEND_KINDS else '<-'}{self.peer_stage}"
        return text

    def to_json(self) -> dict:
        return {"stage": self.stage_id, "action": self.name, "microbatch": self.microbatch_id,
                "peer": self.peer, "peer_stage": self.peer_stage, "group": self.group}

    @classmethod
    def from_json(cls, data: dict) -> Action:
        return cls(ActionKind(data["action"]), data["stage"], data["microbatch"], data["peer"],
                   data["peer_stage"], data["group"])


Program = tuple[Action, ...]
Edge = tuple[int, int]


def chain_edges(num_stages: int) -> frozenset[Edge]:
    return frozenset((s, s + 1) for s in range(num_stages - 1))


Placement = tuple[int, ...]  # the pipeline rank of each stage


def round_robin(num_ranks: int, stages_per_rank: int) -> Placement:
    """Stage k on rank ``k % num_ranks`` (Megatron's virtual stages: rank r holds r, r + p,
    r + 2p, ...)."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_shape(num_ranks: int, stages_per_rank: int) -> Placement:
    """The stages down the ranks, then back up (a zigzag for more than two per rank): with two,
    rank r holds stages r and ``2p - 1 - r``, and rank p - 1 the two at the turn, p - 1 and p,
    which hand off locally. Rank 0 holds the first and the last stage."""
    p = num_ranks
    return tuple(s % p if (s // p) % 2 == 0 else p - 1 - s % p
                 for s in range(p * stages_per_rank))


def stages_of(placement: Placement, rank: int) -> list[int]:
    """The stages `placement` puts on `rank`, in model order."""
    return [s for s, r in enumerate(placement) if r == rank]


@dataclass(frozen=True)
class Schedule:
    """What every pipeline rank runs in one training step (or one evaluation).

    Attributes:
        name: the registry name (`merak.schedule.registry.SCHEDULES`), or a description.
        num_ranks: pipeline ranks p.
        stages_per_rank: stages each rank hosts, v (p * v stages in all).
        num_microbatches: micro-batches per step.
        programs: one program per rank.
        edges: activation edges ``(src_stage, dst_stage)`` (gradients flow back along them).
        placement: the rank of each stage; default `round_robin`.
    """

    name: str
    num_ranks: int
    stages_per_rank: int
    num_microbatches: int
    programs: tuple[Program, ...]
    edges: frozenset[Edge]
    placement: Placement = ()

    def __post_init__(self):
        if not self.placement:
            object.__setattr__(self, "placement",
                               round_robin(self.num_ranks, self.stages_per_rank))
        if len(self.placement) != self.num_stages:
            raise ValueError(f"placement names {len(self.placement)} stages' ranks, not "
                             f"{self.num_stages}")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    def rank_of(self, stage_id: int) -> int:
        return self.placement[stage_id]

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` hosts, in model order."""
        return stages_of(self.placement, rank)

    def stage_actions(self, stage_id: int) -> list[Action]:
        """Stage `stage_id`'s own actions in execution order (per-step actions excluded)."""
        return [a for a in self.programs[self.rank_of(stage_id)] if a.stage_id == stage_id]

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.programs[rank] if a.kind in COMPUTE_KINDS]

    def groups(self, rank: int) -> Iterator[tuple[int, list[Action]]]:
        """Rank `rank`'s posting groups in order: ``(group, its sends and receives)``."""
        current: list[Action] = []
        for action in self.programs[rank]:
            if action.group is None:
                continue
            if current and current[0].group != action.group:
                yield current[0].group, current
                current = []
            current.append(action)
        if current:
            yield current[0].group, current

    def to_json(self) -> dict:
        return {"schedule": self.name, "ranks": self.num_ranks,
                "stages_per_rank": self.stages_per_rank, "microbatches": self.num_microbatches,
                "placement": list(self.placement), "edges": sorted(map(list, self.edges)),
                "programs": [[a.to_json() for a in program] for program in self.programs]}

    @classmethod
    def from_json(cls, data: dict) -> Schedule:
        """The schedule `to_json` wrote (what ``merak simulate --programs`` prints), to
        validate or simulate it again."""
        return cls(data["schedule"], data["ranks"], data["stages_per_rank"],
                   data["microbatches"],
                   tuple(tuple(Action.from_json(a) for a in program)
                         for program in data["programs"]),
                   frozenset(tuple(e) for e in data["edges"]), tuple(data["placement"]))

    def format(self) -> str:
        """One line per rank; a posting group in brackets."""
        lines = []
        for rank, program in enumerate(self.programs):
            words, group = [], None
            for action in program:
                if action.group != group and group is not None:
                    words[-1] += "}"
                if action.group is not None and action.group != group:
                    words.append("{" + str(action))
                else:
                    words.append(str(action))
                group = action.group
            if group is not None:
                words[-1] += "}"
            lines.append(f"rank {rank}: " + " ".join(words))
        return "\n".join(lines)
