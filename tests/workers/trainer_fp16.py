"""fp16 with dynamic loss scaling on dp1 x tp1 x pp2: an inf injected into step 3's forward makes
every rank skip that optimizer step (parameters unchanged) and halve the scale; training then
goes on with finite losses (see test_trainer)."""

from __future__ import annotations

import math

import torch
from common import run_scenarios
from trainer_common import build, train_set
from transformers import TrainerCallback

import merak

POISONED_STEP, START_POWER = 3, 8


class Snapshots(TrainerCallback):
    def __init__(self):
        self.after_step: dict[int, dict[str, torch.Tensor]] = {}
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        self.after_step[state.global_step] = {
            n: p.detach().clone() for n, p in self.trainer.stage.named_parameters()}


def fp16_overflow() -> None:
    merak.init(dp=1, tp=1, pp=2)
    with merak.init_empty_weights():
        model = build("llama")
    calls = {"n": 0}
    per_step = 2  # micro-batches

    def poison(module, args, output):
        if torch.compiler.is_exporting() or not torch.is_grad_enabled():
            return output  # the split's trace, and the runtime's shape discovery (no grad)
        calls["n"] += 1
        if (calls["n"] - 1) // per_step + 1 == POISONED_STEP:
            return output * float("inf")
        return output

    model.model.layers[1].register_forward_hook(poison)  # runs on the last stage
    args = merak.MerakArguments(
        output_dir="out-fp16", max_steps=5, per_device_train_batch_size=2,
        gradient_accumulation_steps=per_step, learning_rate=1e-3, logging_steps=1, fp16=True,
        initial_scale_power=START_POWER, hysteresis=1, report_to="none", disable_tqdm=True,
        use_cpu=True, save_strategy="no")
    snapshots = Snapshots()
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 callbacks=[snapshots])
    snapshots.trainer = trainer
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    scales = [logs[s]["loss_scale"] for s in sorted(logs)]
    assert scales == [2.0 ** START_POWER] * (POISONED_STEP - 1) + \
        [2.0 ** (START_POWER - 1)] * (6 - POISONED_STEP), scales
    assert logs[5]["skipped_steps"] == 1
    before, after = snapshots.after_step[POISONED_STEP - 1], snapshots.after_step[POISONED_STEP]
    assert all(torch.equal(before[n], after[n]) for n in before), "the overflow step updated"
    changed = snapshots.after_step[POISONED_STEP + 1]
    assert any(not torch.equal(after[n], changed[n]) for n in after), "training stopped"
    for step in (1, 2, 4, 5):
        assert math.isfinite(logs[step]["loss"]), logs[step]


if __name__ == "__main__":
    run_scenarios({"fp16-overflow": fp16_overflow})
