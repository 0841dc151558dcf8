"""The 2-rank MerakTrainer launch of test_trainer (dp1 x tp1 x pp2):

- fp16 with dynamic loss scaling: an inf injected into step 3's forward makes every rank skip
  that optimizer step (parameters unchanged) and halve the scale; training then goes on with
  finite losses.
- HF's training flow (trainer_common.RUNS['llama-hf-flow']) on the zero-bubble schedule: its
  summary goes to $MERAK_TRAINER_OUT/merak-pp2-llama-hf-flow.json for test_trainer to compare
  with the single-process HF Trainer's.
- Label smoothing over logits split along the vocabulary across the 2 ranks (a TP group's
  view): the loss and its gradient equal HF's LabelSmoother on the whole logits.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from common import run_scenarios
from trainer_common import (
    COMMON,
    DP,
    MICRO_BATCH,
    RUNS,
    build,
    eval_set,
    flow_summary,
    train_set,
)
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


def hf_flow_pp2() -> None:
    """dp1 x tp1 x pp2 with the reference's batch (MICRO_BATCH * DP rows per micro-batch)."""
    family, extra, _ = RUNS["llama-hf-flow"]
    ctx = merak.init(dp=1, tp=1, pp=2)
    out = Path(os.environ["MERAK_TRAINER_OUT"])
    with merak.init_empty_weights():
        model = build(family)
    args = merak.MerakArguments(
        output_dir=str(out / "pp2-llama-hf-flow"), per_device_train_batch_size=MICRO_BATCH * DP,
        per_device_eval_batch_size=MICRO_BATCH * DP, train_schedule="zero_bubble",
        **COMMON, **extra)
    assert args.activation_checkpointing  # gradient_checkpointing is Merak's recomputation
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 eval_dataset=eval_set())
    trainer.train()
    flow = flow_summary(trainer)
    metrics = trainer.evaluate()  # the best checkpoint's weights, loaded back
    if ctx.rank == 0:
        (out / "merak-pp2-llama-hf-flow.json").write_text(json.dumps({
            "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "eval_loss": metrics["eval_loss"], **flow}))
    dist.barrier()


def label_smoothing_vocab_parallel() -> None:
    from transformers.trainer_pt_utils import LabelSmoother

    from merak.trainer.losses import LabelSmoothedLoss

    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, 8 * size, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 8 * size, (2, 6), generator=generator)
    labels[0, 3] = -100
    whole = logits.clone().requires_grad_()
    expected = LabelSmoother(epsilon=0.2)({"logits": whole}, labels, shift_labels=True)
    expected.backward()
    mine = logits[..., rank * 8:(rank + 1) * 8].clone().requires_grad_()
    loss = LabelSmoothedLoss(0.2, group=dist.group.WORLD)({"logits": mine}, labels)
    loss.backward()
    torch.testing.assert_close(loss, expected.to(loss.dtype))
    torch.testing.assert_close(mine.grad, whole.grad[..., rank * 8:(rank + 1) * 8])


if __name__ == "__main__":
    run_scenarios({"fp16-overflow": fp16_overflow, "hf-flow-pp2": hf_flow_pp2,
                   "label-smoothing-vocab-parallel": label_smoothing_vocab_parallel})
