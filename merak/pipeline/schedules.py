"""Schedule generators: pure functions ``(num_stages, num_microbatches) -> list[list[Action]]``.

Every generator is built from the same three blocks (a micro-batch's forward with its
communication, its backward with its communication, and the per-step tail), so schedules differ
only in the order they place the blocks.
"""

from __future__ import annotations

from collections.abc import Callable

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


def backward_block(stage_id: int, num_stages: int, microbatch_id: int) -> list[Action]:
    """Receive output grads, run and send input grads of one micro-batch's backward."""
    block = []
    if stage_id < num_stages - 1:
        block.append(Action(K.RECV_GRAD, microbatch_id))
    block.append(Action(K.BACKWARD, microbatch_id))
    if stage_id > 0:
        block.append(Action(K.SEND_GRAD, microbatch_id))
    return block


def step_tail() -> list[Action]:
    """Per-step actions after the last backward: tied and dp grad reduction, optimizer step."""
    return [Action(K.REDUCE_TIED_GRADS), Action(K.REDUCE_GRADS), Action(K.OPTIMIZER_STEP)]


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """``ds_default``: all forwards, then all backwards (GPipe). Holds every micro-batch."""
    _check_sizes(num_stages, num_microbatches)
    schedule = []
    for stage_id in range(num_stages):
        actions: list[Action] = []
        for mb in range(num_microbatches):
            actions += forward_block(stage_id, num_stages, mb)
        for mb in range(num_microbatches):
            actions += backward_block(stage_id, num_stages, mb)
        schedule.append(actions + step_tail())
    return schedule


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """``1f1b``: warm up with `num_stages - stage_id - 1` forwards, then alternate one forward
    and one backward, then drain the remaining backwards. Stage s holds at most
    ``min(num_stages - s, num_microbatches)`` micro-batches in flight."""
    _check_sizes(num_stages, num_microbatches)
    schedule = []
    for stage_id in range(num_stages):
        num_warmup = min(num_stages - stage_id - 1, num_microbatches)
        actions: list[Action] = []
        for mb in range(num_warmup):
            actions += forward_block(stage_id, num_stages, mb)
        for i in range(num_microbatches - num_warmup):
            actions += forward_block(stage_id, num_stages, num_warmup + i)
            actions += backward_block(stage_id, num_stages, i)
        for mb in range(num_microbatches - num_warmup, num_microbatches):
            actions += backward_block(stage_id, num_stages, mb)
        schedule.append(actions + step_tail())
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "ds_default": gpipe,
    "1f1b": one_f_one_b,
}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The action lists of schedule `name` (one of `SCHEDULES`)."""
    try:
        generator = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown train_schedule {name!r}; choose one of "
                         f"{sorted(SCHEDULES)}") from None
    return generator(num_stages, num_microbatches)


def format_schedule(schedule: Schedule) -> str:
    """One line per stage, actions separated by spaces (for logs and debugging)."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in actions)
                     for s, actions in enumerate(schedule))
