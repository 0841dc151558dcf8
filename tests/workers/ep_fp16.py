"""fp16 with dynamic loss scaling under expert parallelism (imported by ep_trainer.py's 4-rank
scenarios; test_expert_parallel_fp16 asserts on what it returns).

The tiny Qwen3-MoE of ep_trainer, written by `save_pretrained` and loaded under
`init_empty_weights`, trains STEPS steps at dp2 ep2 pp2 with `fp16=True` (the dynamic scale at
2**16, as HF Trainer's GradScaler starts, and `hysteresis=1`: every overflow halves it, as
GradScaler's backoff does). At step POISONED_STEP one rank's expert gradient (`gate_up_proj` of
the last stage's MoE layer, on ep rank 1 only) is made inf in backward: at dp2 ep2 the
expert-data-parallel group of that tensor is the rank alone, so only the loss scaler's
world-wide overflow check can make the other three ranks skip the step. Each rank returns, per
step, its scaler's scale, its skipped count and whether the step changed its parameters, with
the logged losses and gradient norms; `reference` runs single-process HF Trainer on the same
rows with accelerate's fp16 path (float16 autocast and torch's GradScaler, which accelerate
turns off on CPU and the reference turns back on) with the same inf injected into the
whole `gate_up_proj` gradient at the same step."""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers as tf
from common import out_dir
from ep_trainer import (
    DP,
    FIELDS,
    MICRO_BATCH,
    MICROBATCHES,
    STEPS,
    _trainer,
    logged,
    save_hub,
    train_set,
)

from merak.expert_parallel import experts_modules

FP16_RUN = "trainer-qwen3_moe-dp2-ep2-pp2-fp16"
POISONED_STEP, POWER = 3, 16


class _Watch(tf.TrainerCallback):
    """Per step: the loss scale after it, and whether it changed the parameters; keeps
    `at["step"]`, the step being run (1-based), for the poisoning gradient hook. `setup()`
    gives (parameters, scale reader, the parameter to poison or None) once training begins
    (MerakTrainer builds its stage and engine in `train`)."""

    def __init__(self, setup):
        self.setup, self.at = setup, {"step": 0}
        self.params, self.scale = [], None
        self.before: list[torch.Tensor] = []
        self.scales: list[float] = []
        self.changed: list[bool] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.params, self.scale, poisoned = self.setup()
        if poisoned is not None:
            _poison(poisoned, self.at)

    def on_step_begin(self, args, state, control, **kwargs):
        self.at["step"] = state.global_step + 1
        self.before = [p.detach().clone() for p in self.params]

    def on_step_end(self, args, state, control, **kwargs):
        self.changed.append(any(not torch.equal(b, p) for b, p in zip(self.before, self.params)))
        self.scales.append(float(self.scale()))


def _poison(param: torch.nn.Parameter, at: dict) -> None:
    """Every gradient of `param` in step POISONED_STEP's backward becomes inf."""
    def hook(grad):
        return grad * float("inf") if at["step"] == POISONED_STEP else grad
    param.register_hook(hook)


def _curve(trainer) -> dict[str, list[float]]:
    return logged(trainer, ("loss", "grad_norm", "learning_rate"))


def fp16_run() -> dict:
    root = out_dir() / FP16_RUN
    hub = root / "hub"
    if dist.get_rank() == 0:
        save_hub("qwen3_moe", hub)
    dist.barrier()
    trainer = _trainer(hub, root / "merak", (2, 2, 2, 0, 1), save_strategy="no", fp16=True,
                       initial_scale_power=POWER, hysteresis=1)
    ctx = trainer.ctx
    poisoned = ctx.pp_rank == ctx.pp - 1 and ctx.ep_rank == 1

    def setup():
        (module,) = experts_modules(trainer.stage).values()  # the stage's one MoE layer
        return (list(trainer.stage.parameters()), lambda: trainer.engine.scaler.scale,
                module.gate_up_proj if poisoned else None)

    watch = _Watch(setup)
    trainer.add_callback(watch)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss_scale" in h]
    return {"curve": _curve(trainer), "scales": watch.scales, "changed": watch.changed,
            "logged_scales": [h["loss_scale"] for h in logs],
            "skipped_steps": [h["skipped_steps"] for h in logs], "poisoned": poisoned,
            "edp_size": dist.get_world_size(ctx.edp_group), "hub": str(hub)}


def reference(hub, out) -> dict:
    """Single-process HF Trainer, fp16 on CPU, on the same rows (a Merak rank's micro-batch
    each), with the whole `gate_up_proj` gradient of the last MoE layer made inf at
    POISONED_STEP: its curve, its GradScaler's scale after each step and which steps changed
    the parameters. Run by the test, outside torchrun."""
    args = tf.TrainingArguments(output_dir=str(out), max_steps=STEPS, save_strategy="no",
                                gradient_accumulation_steps=DP * MICROBATCHES, fp16=True,
                                **FIELDS)
    model = tf.AutoModelForCausalLM.from_pretrained(hub)
    trainer = tf.Trainer(model=model, args=args, train_dataset=train_set())
    # accelerate leaves fp16 off on CPU (no autocast, no scaler: it trains in fp32); its GPU
    # path turned on here: forwards under float16 autocast, torch's GradScaler on the loss
    assert trainer.accelerator.scaler is None
    scaler = trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** POWER)
    trainer.accelerator.native_amp = True
    last = list(experts_modules(model).values())[-1]
    watch = _Watch(lambda: (list(model.parameters()), scaler.get_scale, last.gate_up_proj))
    trainer.add_callback(watch)
    trainer.train()
    return {"curve": _curve(trainer), "scales": watch.scales, "changed": watch.changed,
            "micro_batch": MICRO_BATCH}
