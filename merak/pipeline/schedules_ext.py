"""Merak's recomputation-aware 1F1B variants, and zero-bubble pipelining.

Merak (TPDS 2023) observes that under 1F1B with recomputation the recomputation sits on the
critical path: a stage waits for its output gradient, then recomputes, then runs the backward.
Its three schedules move that work off the critical path without raising activation memory:

- `pre_recompute_1f1b`: each recomputation runs before the wait for its output gradient, so it
  overlaps the gradient's transfer and the downstream backward that produces it.
- `last_no_recompute_1f1b`: the last stage never recomputes; its forward and backward of a
  micro-batch are adjacent, so keeping one micro-batch whole costs it nothing extra.
- `shifted_critical_path`: both. Then the backward wave meets no recomputation anywhere: the
  last stage has none and every other stage has finished its rerun when the gradient arrives.
  Merak also shifts the first backwards of the last stages (extra warm-up forwards on stage
  p-2, a rerun before the forward). We searched those reorderings with the simulator (every
  extra-warm-up vector within the memory bound, for p in 2..8; reruns before the forward; with
  and without p2p latency): none shortened the makespan and extra warm-ups lengthened it (4
  stages, 8 micro-batches, forward 1, backward 2, rerun 1: 39 without, 49 or more with), so
  this schedule keeps 1F1B's order and in-flight bound.

`zero_bubble` (ZB-H1 of Qi et al., ICLR 2024) splits each backward into the input gradient
(`backward_input`, on the critical path: it is sent upstream) and the weight gradient
(`backward_weight`, deferred to fill what would be bubbles), within 1F1B's peak in-flight
count.
"""

from __future__ import annotations

from merak.pipeline.actions import Action, ActionKind, Schedule
from merak.pipeline.schedules import (
    Recompute,
    backward_block,
    check_sizes,
    one_f_one_b,
    one_f_one_b_order,
    recompute_flags,
    step_tail,
)

K = ActionKind


def pre_recompute_1f1b(num_stages: int, num_microbatches: int,
                       recompute: Recompute = True) -> Schedule:
    """1F1B with every recomputation issued before the wait for its output gradient."""
    return one_f_one_b(num_stages, num_microbatches, recompute, early_recompute=True)


def last_no_recompute_1f1b(num_stages: int, num_microbatches: int,
                           recompute: Recompute = True) -> Schedule:
    """1F1B with recomputation on every stage but the last."""
    flags = recompute_flags(recompute, num_stages)
    flags[-1] = False
    return one_f_one_b(num_stages, num_microbatches, flags)


def shifted_critical_path(num_stages: int, num_microbatches: int,
                          recompute: Recompute = True) -> Schedule:
    """Both of the above: early recomputation and none on the last stage (see the module
    docstring for the reorderings tried and why they are not part of it)."""
    flags = recompute_flags(recompute, num_stages)
    flags[-1] = False
    return one_f_one_b(num_stages, num_microbatches, flags, early_recompute=True)


def zero_bubble(num_stages: int, num_microbatches: int, recompute: Recompute = False) -> Schedule:
    """ZB-H1: 1F1B's order with each backward split; stage s defers its first s weight
    gradients, so the input gradients race upstream and the deferred weight gradients fill the
    drain. With equal forward, input-gradient and weight-gradient times each stage idles
    ``(p - 1)`` of them, a third of 1F1B's ``3 (p - 1)``. At most ``num_stages`` micro-batches
    await their weight gradient on any stage: 1F1B's peak (stage 0's), though later stages now
    reach it too (a micro-batch waiting only for its weight gradient keeps just the inputs of its
    weight-using ops)."""
    check_sizes(num_stages, num_microbatches)
    flags = recompute_flags(recompute, num_stages)
    schedule = []
    for stage_id in range(num_stages):
        split = _SplitBackward(stage_id, num_stages, flags[stage_id])
        actions = one_f_one_b_order(stage_id, num_stages, num_microbatches, split)
        actions += [Action(K.BACKWARD_WEIGHT, mb) for mb in split.deferred]
        schedule.append(actions + step_tail())
    return schedule


class _SplitBackward:
    """ZB-H1's backward blocks of one stage: the input gradient, then the weight gradient of
    the micro-batch `stage_id` backwards earlier (the rest wait in `deferred`)."""

    def __init__(self, stage_id: int, num_stages: int, recompute: bool):
        self.stage_id, self.num_stages, self.recompute = stage_id, num_stages, recompute
        self.deferred: list[int] = []

    def __call__(self, mb: int) -> list[Action]:
        block = [Action(K.BACKWARD_INPUT, mb) if a.kind is K.BACKWARD else a
                 for a in backward_block(self.stage_id, self.num_stages, mb, self.recompute)]
        self.deferred.append(mb)
        if len(self.deferred) > self.stage_id:
            block.append(Action(K.BACKWARD_WEIGHT, self.deferred.pop(0)))
        return block


SCHEDULES = {
    "pre_recompute_1f1b": pre_recompute_1f1b,
    "last_no_recompute_1f1b": last_no_recompute_1f1b,
    "shifted_critical_path": shifted_critical_path,
    "zero_bubble": zero_bubble,
}
