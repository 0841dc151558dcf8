"""The fp16 loss scaler (`merak.engine.loss_scale.LossScaler`) against DeepSpeed's
`DynamicLossScaler` rule, step by step, on one process: the expected scales below are worked out
by hand from that rule (see each test's docstring), not read off the code under test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from merak import MerakArguments
from merak.engine.loss_scale import LossScaler

OVER, CLEAN = "overflow", "clean"


def _driven(**options):
    """A scaler over one parameter, and `step(kind)`: one optimizer step whose gradient is
    finite (CLEAN) or inf (OVER), through the scaler's hook as the interpreter calls it; returns
    whether the optimizer step was skipped."""
    param = torch.nn.Parameter(torch.zeros(2))
    engine = SimpleNamespace(stage=SimpleNamespace(parameters=lambda: [param]))
    ctx = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    scaler = LossScaler(ctx, **options)
    scaler.bind(engine)

    def step(kind: str) -> bool:
        value = float("inf") if kind == OVER else 1.0
        param.grad = torch.full((2,), value * scaler.scale)
        scaler.on_instruction_begin("optimizer_step", None)
        if kind == CLEAN:
            assert torch.equal(param.grad, torch.ones(2))  # unscaled before the optimizer
        assert engine.loss_scale == scaler.scale  # what the next micro-batches are scaled by
        return engine.skip_optimizer_step

    return scaler, step


def test_defaults_are_deepspeeds_and_start_where_grad_scaler_does():
    """DeepSpeed's fp16 defaults: initial_scale_power 16 (torch.amp.GradScaler's 65536 too),
    loss_scale_window 1000, hysteresis 2, consecutive_hysteresis off, min_loss_scale 1."""
    args = MerakArguments(output_dir="out", fp16=True, use_cpu=True)
    assert (args.initial_scale_power, args.loss_scale_window, args.hysteresis,
            args.consecutive_hysteresis, args.min_loss_scale) == (16, 1000, 2, False, 1.0)
    scaler, _ = _driven()
    assert scaler.scale == 2.0 ** 16 == torch.amp.GradScaler("cpu").get_scale()


def test_scale_sequence_follows_deepspeeds_rule():
    """Start 16, window 3, hysteresis 2, floor 2. The rule: an overflow with allowance left
    (> 1) only uses one up; with the allowance at 1 it halves (every further overflow halves
    too, until the allowance is restored); a clean step preceded by a positive multiple of
    `window` consecutive clean steps doubles and restores the allowance; an overflow with the
    scale already at the floor stops training."""
    scaler, step = _driven(initial_scale_power=4, window=3, hysteresis=2, min_scale=2.0)
    kinds = [CLEAN, CLEAN, CLEAN,  # 0, 1, 2 clean steps before: no growth
             CLEAN,  # 3 clean steps before it: 16 -> 32, allowance 2
             OVER,  # allowance 2 -> 1, scale kept
             OVER, OVER,  # allowance used up: 32 -> 16 -> 8 (not every second overflow)
             CLEAN,  # a clean step does not restore the allowance (consecutive_hysteresis off)
             OVER,  # 8 -> 4
             CLEAN, CLEAN, CLEAN, CLEAN,  # the 4th clean in a row follows 3: 4 -> 8, allowance 2
             OVER, OVER, OVER]  # 2 -> 1 kept at 8; 8 -> 4; 4 -> 2 (the floor)
    expected = [16, 16, 16, 32, 32, 16, 8, 8, 4, 4, 4, 4, 8, 8, 4, 2]
    scales, skipped = [], []
    for kind in kinds:
        skipped.append(step(kind))
        scales.append(scaler.scale)
    assert scales == expected
    assert skipped == [kind == OVER for kind in kinds]
    assert scaler.skipped_steps == kinds.count(OVER) == 7
    with pytest.raises(RuntimeError, match="already at min_loss_scale=2.0.*Lower the learning"):
        step(OVER)  # at the floor with no allowance: nothing smaller to try


def test_growth_window_counts_from_the_last_overflow():
    """Window 2, hysteresis 1 (every overflow halves): after an overflow the scale doubles on
    the third clean step (the first preceded by 2 clean ones), then every second one."""
    scaler, step = _driven(initial_scale_power=3, window=2, hysteresis=1)
    scales = []
    for kind in [OVER, CLEAN, CLEAN, CLEAN, CLEAN, CLEAN, OVER, CLEAN]:
        step(kind)
        scales.append(scaler.scale)
    assert scales == [4, 4, 4, 8, 8, 16, 8, 8]


@pytest.mark.parametrize("consecutive,expected", [
    (False, [16, 16, 8, 4, 4, 2]),  # the clean step leaves the used allowance used
    (True, [16, 16, 16, 8, 8, 8]),  # every clean step restores it: only 2 in a row halve
])
def test_consecutive_hysteresis(consecutive, expected):
    scaler, step = _driven(initial_scale_power=4, hysteresis=2,
                           consecutive_hysteresis=consecutive)
    scales = []
    for kind in [OVER, CLEAN, OVER, OVER, CLEAN, OVER]:
        step(kind)
        scales.append(scaler.scale)
    assert scales == expected


def test_static_scale_never_moves_but_still_skips():
    scaler, step = _driven(static_scale=128.0)
    assert step(OVER) and scaler.scale == 128.0
    for _ in range(3):
        assert not step(CLEAN)
    assert scaler.scale == 128.0 and scaler.skipped_steps == 1


@pytest.mark.parametrize("after,expected", [
    ([CLEAN, CLEAN], 32.0),  # the saved 2 clean steps count: the 2nd one after resuming doubles
    ([OVER], 8.0),  # the allowance the saved overflow used stays used: the next one halves
])
def test_state_round_trips_the_allowance_and_the_window(after, expected):
    """A resumed run goes on with the same scale history (window 3, hysteresis 2)."""
    first, step_first = _driven(initial_scale_power=4, window=3, hysteresis=2)
    second, step_second = _driven(initial_scale_power=10, window=3, hysteresis=2)
    for kind in [OVER, CLEAN, CLEAN]:
        step_first(kind)
    second.load_state_dict(first.state_dict())
    for kind in after:
        step_first(kind)
        step_second(kind)
        assert second.scale == first.scale
    assert first.scale == expected
