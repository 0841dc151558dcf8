"""Schedule generators: pure functions
``(num_stages, num_microbatches, recompute=...) -> list[list[Action]]``.

Every generator is built from the same three blocks (a micro-batch's forward with its
communication, its backward with its communication, and the per-step tail), so schedules differ
only in the order they place the blocks. `recompute` says which stages checkpoint activations
(True for all, or one flag per stage): their backward blocks then hold a `recompute` action.
Merak's recomputation-aware 1F1B variants and the schedules beyond them live in
`merak.pipeline.schedules_ext`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from merak.pipeline.actions import Action, ActionKind, Schedule

K = ActionKind


def forward_block(stage_id: int, num_stages: int, microbatch_id: int) -> list[Action]:
    """Load, receive, run and send one micro-batch's forward on `stage_id`."""
    block = [Action(K.LOAD, microbatch_id)]
    if stage_id > 0:
        block.append(Action(K.RECV_ACT, microbatch_id))
    block.append(Action(K.FORWARD, microbatch_id))
    if stage_id < num_stages - 1:
        block.append(Action(K.SEND_ACT, microbatch_id))
    return block


def backward_block(stage_id: int, num_stages: int, microbatch_id: int, recompute: bool = False,
                   early: bool = False) -> list[Action]:
    """Receive output grads, run and send input grads of one micro-batch's backward.

    With `recompute`, the checkpointed blocks are rerun first: right before the backward, or
    with `early` before the output gradient is waited for (so the rerun overlaps its transfer).
    """
    block = []
    if recompute and early:
        block.append(Action(K.RECOMPUTE, microbatch_id))
    if stage_id < num_stages - 1:
        block.append(Action(K.RECV_GRAD, microbatch_id))
    if recompute and not early:
        block.append(Action(K.RECOMPUTE, microbatch_id))
    block.append(Action(K.BACKWARD, microbatch_id))
    if stage_id > 0:
        block.append(Action(K.SEND_GRAD, microbatch_id))
    return block


def step_tail() -> list[Action]:
    """Per-step actions after the last backward: tied and dp grad reduction, optimizer step."""
    return [Action(K.REDUCE_TIED_GRADS), Action(K.REDUCE_GRADS), Action(K.OPTIMIZER_STEP)]


Recompute = bool | Sequence[bool]


def recompute_flags(recompute: Recompute, num_stages: int) -> list[bool]:
    """One flag per stage from True/False or a per-stage sequence."""
    if isinstance(recompute, bool):
        return [recompute] * num_stages
    flags = [bool(r) for r in recompute]
    if len(flags) != num_stages:
        raise ValueError(f"recompute has {len(flags)} flags for {num_stages} stages")
    return flags


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int, recompute: Recompute = False) -> Schedule:
    """``ds_default``: all forwards, then all backwards (GPipe). Holds every micro-batch."""
    check_sizes(num_stages, num_microbatches)
    flags = recompute_flags(recompute, num_stages)
    schedule = []
    for stage_id in range(num_stages):
        actions: list[Action] = []
        for mb in range(num_microbatches):
            actions += forward_block(stage_id, num_stages, mb)
        for mb in range(num_microbatches):
            actions += backward_block(stage_id, num_stages, mb, flags[stage_id])
        schedule.append(actions + step_tail())
    return schedule


def one_f_one_b_order(stage_id: int, num_stages: int, num_microbatches: int,
                      backward: Callable[[int], list[Action]]) -> list[Action]:
    """One stage's 1F1B order (without the step tail), with `backward(mb)` giving each
    micro-batch's backward block: `num_stages - stage_id - 1` warm-up forwards, then one
    forward and one backward at a time, then the remaining backwards."""
    num_warmup = min(num_stages - stage_id - 1, num_microbatches)
    actions: list[Action] = []
    for mb in range(num_warmup):
        actions += forward_block(stage_id, num_stages, mb)
    for i in range(num_microbatches - num_warmup):
        actions += forward_block(stage_id, num_stages, num_warmup + i)
        actions += backward(i)
    for mb in range(num_microbatches - num_warmup, num_microbatches):
        actions += backward(mb)
    return actions


def one_f_one_b(num_stages: int, num_microbatches: int, recompute: Recompute = False,
                early_recompute: bool = False) -> Schedule:
    """``1f1b`` (`one_f_one_b_order`). Stage s holds at most ``min(num_stages - s,
    num_microbatches)`` micro-batches in flight. `early_recompute` places each recomputation
    before the wait for its output gradient (`backward_block`)."""
    check_sizes(num_stages, num_microbatches)
    flags = recompute_flags(recompute, num_stages)
    return [one_f_one_b_order(s, num_stages, num_microbatches,
                              functools.partial(backward_block, s, num_stages,
                                                recompute=flags[s], early=early_recompute))
            + step_tail() for s in range(num_stages)]


SCHEDULES: dict[str, Callable[..., Schedule]] = {"ds_default": gpipe, "1f1b": one_f_one_b}
"""Name -> generator; `merak.pipeline.schedules_ext` adds its schedules when imported (below)."""

NEEDS_RECOMPUTE = ("pre_recompute_1f1b", "last_no_recompute_1f1b", "shifted_critical_path")
"""Merak's schedules: variants of 1F1B with recomputation, meaningless without it."""


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  recompute: Recompute = False) -> Schedule:
    """The action lists of schedule `name` (one of `SCHEDULES`) for `num_stages` stages.

    Args:
        recompute: which stages checkpoint activations (True: all); Merak's recomputation
            schedules need it on.
    """
    try:
        generator = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown train_schedule {name!r}; choose one of "
                         f"{sorted(SCHEDULES)}") from None
    if name in NEEDS_RECOMPUTE and not any(recompute_flags(recompute, num_stages)):
        raise ValueError(f"train_schedule {name!r} reorders recomputation; turn on "
                         f"activation checkpointing (activation_checkpointing=True, or "
                         f"--recompute-cost in the simulator)")
    return generator(num_stages, num_microbatches, recompute)


def format_schedule(schedule: Schedule) -> str:
    """One line per stage, actions separated by spaces (for logs and debugging)."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in actions)
                     for s, actions in enumerate(schedule))


from merak.pipeline import schedules_ext  # registers its schedules (and imports ours)

SCHEDULES.update(schedules_ext.SCHEDULES)
