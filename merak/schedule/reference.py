"""A reference model's forwards as instructions of the schedule (TRL's DPOTrainer and
KTOTrainer): what the strategy planner's simulator times and the energy planner sets clocks for,
like any other computation.

A preference trainer compares the policy's log-probabilities with a frozen reference's. The
reference's forwards run in one of two places (`REFERENCE_MODES`):

- ``"before"``: one forward-only pass over the training rows before the first step (the
  initial policy, or the policy with its LoRA adapters off, never changes: Merak's precomputed
  and default setups). Its schedule is `merak.schedule.registry.reference_pass`: a
  forward-only schedule whose forwards are ``reference_forward`` instructions; it reads each
  training row once, so it costs one such schedule per step of the first epoch.
- ``"per_step"`` (the policy with its adapters off, run on every micro-batch) and
  ``"replica"`` (a second model, e.g. an explicit ``ref_model`` or one that follows the policy,
  ``sync_ref_model``, kept as a frozen replica of the reference's stage on each rank, split as
  the policy is): every stage runs a ``reference_forward`` of each micro-batch right before the
  policy's ``forward`` of it (`with_reference`). Its activations travel with the policy's in
  the same message, so the schedule gains no transfer. ``"replica"`` also holds the replica's
  weights on every rank.

A ``reference_forward`` keeps nothing for a backward and has none.
"""

from __future__ import annotations

import dataclasses

from merak.schedule.actions import Action, ActionKind, Schedule

K = ActionKind
REFERENCE_MODES = ("none", "before", "per_step", "replica")
PER_STEP_MODES = ("per_step", "replica")  # the reference runs inside every training step


def check_reference_mode(mode: str) -> str:
    if mode not in REFERENCE_MODES:
        raise ValueError(f"the reference mode must be one of {REFERENCE_MODES}, got {mode!r}")
    return mode


def runs_reference(schedule: Schedule) -> bool:
    """Whether `schedule` runs a reference model's forward (``reference_forward``) anywhere."""
    return any(a.kind is K.REFERENCE_FORWARD for program in schedule.programs for a in program)


def with_reference(schedule: Schedule) -> Schedule:
    """`schedule` with a ``reference_forward`` of each (stage, micro-batch) right before the
    policy's ``forward`` of it: after the receive that brings both models' activations, before
    the send that carries both on."""
    programs = []
    for program in schedule.programs:
        out: list[Action] = []
        for action in program:
            if action.kind is K.REFERENCE_FORWARD:
                raise ValueError(f"schedule {schedule.name!r} already runs the reference")
            if action.kind is K.FORWARD:
                out.append(Action(K.REFERENCE_FORWARD, action.stage_id, action.microbatch_id))
            out.append(action)
        programs.append(tuple(out))
    return dataclasses.replace(schedule, programs=tuple(programs))
