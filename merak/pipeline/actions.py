"""The schedule vocabulary: what one pipeline stage does, one action at a time.

A schedule is plain data, ``list[list[Action]]`` (one ordered list per stage). The interpreter
executes it, the simulator times it, the validator proves it cannot deadlock, the timeline draws
it and the energy planner plans clocks over it: all read these same objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ActionKind(str, enum.Enum):
    """Kinds of pipeline instructions. The value is the instruction name hooks receive."""

    LOAD = "load"                              # read this stage's inputs of a micro-batch
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"                    # rerun checkpointed blocks before the backward
    BACKWARD_INPUT = "backward_input"          # zero-bubble: input gradients only (sent on)
    BACKWARD_WEIGHT = "backward_weight"        # zero-bubble: the weight gradients, later
    SEND_ACT = "send_act"                      # activations to the downstream consumer stages
    RECV_ACT = "recv_act"                      # activations from the upstream producer stages
    SEND_GRAD = "send_grad"                    # input gradients to the upstream producer stages
    RECV_GRAD = "recv_grad"                    # output gradients from the downstream stages
    REDUCE_TIED_GRADS = "reduce_tied_grads"    # sum grads of weights tied across stages
    REDUCE_GRADS = "reduce_grads"              # data-parallel gradient all-reduce
    OPTIMIZER_STEP = "optimizer_step"

    def __str__(self) -> str:
        return self.value


BACKWARD_KINDS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                            ActionKind.BACKWARD_WEIGHT})
COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.RECOMPUTE}) | BACKWARD_KINDS
SEND_KINDS = frozenset({ActionKind.SEND_ACT, ActionKind.SEND_GRAD})
RECV_KINDS = frozenset({ActionKind.RECV_ACT, ActionKind.RECV_GRAD})
P2P_KINDS = SEND_KINDS | RECV_KINDS
STEP_KINDS = frozenset({ActionKind.REDUCE_TIED_GRADS, ActionKind.REDUCE_GRADS,
                        ActionKind.OPTIMIZER_STEP})


@dataclass(frozen=True, order=True)
class Action:
    """One instruction of one stage; `microbatch_id` is None for per-step actions."""

    kind: ActionKind
    microbatch_id: int | None = None

    @property
    def name(self) -> str:
        return self.kind.value

    def __str__(self) -> str:
        return self.name if self.microbatch_id is None else f"{self.name}[{self.microbatch_id}]"


Schedule = list[list[Action]]
