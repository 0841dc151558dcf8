"""The 2-rank MerakTrainer launch of test_trainer (dp1 x tp1 x pp2):

- fp16 with dynamic loss scaling: an inf injected into step 3's forward; each step's scale,
  skipped count, loss and whether it changed the parameters (test_trainer asserts the step
  is skipped everywhere and the scale halved, and training goes on).
- trainer_common.PP2_RUNS, among them HF's training flow on the zero-bubble schedule: each
  run's summary goes to $MERAK_TRAINER_OUT/merak-pp2-<run>.json for test_trainer to compare
  with the single-process HF Trainer's.
- Label smoothing over logits split along the vocabulary across the 2 ranks (a TP group's
  view): the loss and its gradient equal HF's LabelSmoother on the whole logits.
- torch_compile (pp2): the compiled blocks' losses and the eager ones, with and without
  recomputation (which reruns the compiled blocks); the stage's state_dict keys.
- neftune_noise_alpha (pp2): the losses, and a single-process model's with the same noise
  (`merak.trainer.neftune`'s seeding, dp rank 0) added to its embedding and without it; the
  eval loss. At tp2 (vocab-parallel embedding): whether both TP ranks added the same noise and
  kept their replicated parameters identical.
Each scenario returns its figures; test_trainer asserts them.
- `trainer_fields.SCENARIOS`: push_to_hub, ignore_data_skip, dataloader workers and
  auto_find_batch_size (see that module).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import trainer_fields
from common import run_scenarios
from trainer_common import (
    COMMON,
    DP,
    MICRO_BATCH,
    PP2_RUNS,
    RUNS,
    SEED,
    build,
    eval_set,
    fine_tuning_eval_set,
    fine_tuning_set,
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


def fp16_overflow() -> dict:
    """The loss scale, skipped steps and losses each step logged, and which steps changed the
    parameters, with an inf in step POISONED_STEP's forward."""
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
    logs = [h for h in trainer.state.log_history if "loss" in h]
    after = snapshots.after_step

    def changed(step: int) -> bool:  # did step `step` change any parameter
        return any(not torch.equal(after[step - 1][n], after[step][n]) for n in after[step])

    return {"steps": [h["step"] for h in logs], "loss_scale": [h["loss_scale"] for h in logs],
            "skipped_steps": [h["skipped_steps"] for h in logs],
            "loss": [h["loss"] for h in logs],
            "changed": {step: changed(step) for step in range(2, 6)}}


def pp2_run(name: str) -> None:
    """RUNS[name] on dp1 x tp1 x pp2 with the reference's batch (MICRO_BATCH * DP rows per
    micro-batch): its summary goes to merak-pp2-<name>.json (the HF-flow run on the zero-bubble
    schedule)."""
    family, extra, merak_only = RUNS[name]
    ctx = merak.init(dp=1, tp=1, pp=2)
    out = Path(os.environ["MERAK_TRAINER_OUT"])
    with merak.init_empty_weights():
        model = build(family)
    hf_flow = name.endswith("hf-flow")
    args = merak.MerakArguments(
        output_dir=str(out / f"pp2-{name}"), per_device_train_batch_size=MICRO_BATCH * DP,
        per_device_eval_batch_size=MICRO_BATCH * DP,
        **({"train_schedule": "zero_bubble"} if hf_flow else {}), **COMMON, **extra,
        **merak_only)
    if hf_flow:
        assert args.activation_checkpointing  # gradient_checkpointing is Merak's recomputation
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=fine_tuning_set(),
                                 eval_dataset=fine_tuning_eval_set())
    trainer.train()
    flow = flow_summary(trainer) if hf_flow else {}
    metrics = trainer.evaluate()  # with load_best_model_at_end, the best checkpoint's weights
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if ctx.rank == 0:
        (out / f"merak-pp2-{name}.json").write_text(json.dumps({
            "loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "learning_rate": [h["learning_rate"] for h in logs],
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


# ---- torch_compile and neftune_noise_alpha: short runs of the llama model (2 blocks)
SHORT = {"max_steps": 3, "per_device_train_batch_size": MICRO_BATCH,
         "gradient_accumulation_steps": 2, "logging_steps": 1, "seed": SEED,
         "train_sampling_strategy": "sequential", "report_to": "none", "disable_tqdm": True,
         "use_cpu": True, "save_strategy": "no"}
COMPILE_BACKEND = "aot_eager"


def _short_run(name: str, eval_dataset=None, **fields):
    """A MerakTrainer run of SHORT + `fields` on the current layout: (trainer, step losses)."""
    with merak.init_empty_weights():
        model = build("llama")
    args = merak.MerakArguments(output_dir=str(Path(os.environ["MERAK_TRAINER_OUT"]) / name),
                                **{**SHORT, **fields})
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 eval_dataset=eval_dataset)
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def torch_compile_pp2() -> dict:
    """The eager run's losses and, compiled with and without recomputation, each run's losses,
    whether it recomputes, which blocks hold a compiled forward and the state_dict keys."""
    from torch._dynamo.utils import counters

    from merak.stages.stage import block_names

    merak.init(dp=1, tp=1, pp=2)
    eager, expected = _short_run("compile-eager", learning_rate=1e-3)
    figures = {"eager_losses": expected, "eager_keys": list(eager.stage.state_dict())}
    for recompute in (False, True):
        frames, start = counters["frames"]["ok"], time.perf_counter()
        trainer, losses = _short_run(f"compile-{recompute}", learning_rate=1e-3,
                                     torch_compile_backend=COMPILE_BACKEND,
                                     gradient_checkpointing=recompute)
        print(f"rank {dist.get_rank()}: torch_compile ({COMPILE_BACKEND}, recompute={recompute})"
              f" run {time.perf_counter() - start:.1f} s, "
              f"{counters['frames']['ok'] - frames} frames compiled", flush=True)
        stage, engine = trainer.stage, trainer.engine.interpreter
        recomputes = bool(engine.segments[stage.stage_id])
        engine.remove_recomputation()  # the compiled forward comes back
        blocks = block_names(stage.split, stage.stage_id)
        figures[f"recompute={recompute}"] = {
            "torch_compile": trainer.args.torch_compile, "recomputes": recomputes,
            "blocks": len(blocks), "losses": losses, "keys": list(stage.state_dict()),
            "compiled": [n for n in blocks if "forward" in vars(stage.get_submodule(n))]}
    return figures


NEFTUNE_ALPHA, NEFTUNE_LR = 5.0, 1e-2
NEFTUNE = {"learning_rate": NEFTUNE_LR, "optim": "sgd", "lr_scheduler_type": "constant",
           "max_grad_norm": 0.0}


def _neftune_reference(noise: bool, eval_rows: list) -> tuple[list[float], float]:
    """SHORT's steps of SGD on one process, each micro-batch's embedding noised as MerakTrainer
    noises it at dp rank 0 (step, micro-batch, first call): the step losses and the eval loss
    (mean over micro-batches of MICRO_BATCH rows, no noise)."""
    from merak.trainer.neftune import neftune_noise, noise_seed

    model = build("llama")
    model.train()
    at = {"step": 0, "mb": 0}

    def hook(module, args, output):
        if not module.training:
            return None
        return output + neftune_noise(output, NEFTUNE_ALPHA,
                                      noise_seed(SEED, 0, at["step"], at["mb"], 0))

    if noise:
        model.get_input_embeddings().register_forward_hook(hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=NEFTUNE_LR)
    rows, m = train_set(), SHORT["gradient_accumulation_steps"]
    losses = []
    for step in range(SHORT["max_steps"]):
        total = 0.0
        for mb in range(m):
            at.update(step=step, mb=mb)
            first = (step * m + mb) * MICRO_BATCH
            ids = torch.stack([rows[i]["input_ids"] for i in range(first, first + MICRO_BATCH)])
            loss = model(input_ids=ids, labels=ids).loss
            (loss / m).backward()
            total += loss.item() / m
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        chunks = [torch.stack([r["input_ids"] for r in eval_rows[i:i + MICRO_BATCH]])
                  for i in range(0, len(eval_rows), MICRO_BATCH)]
        eval_loss = sum(model(input_ids=c, labels=c).loss.item() for c in chunks) / len(chunks)
    return losses, eval_loss


def neftune_pp2() -> dict:
    """The run's losses and eval loss; a single-process model's with the same noise, and
    without."""
    merak.init(dp=1, tp=1, pp=2)
    eval_rows = eval_set()[:4 * MICRO_BATCH]
    trainer, losses = _short_run("neftune", eval_dataset=eval_rows,
                                 per_device_eval_batch_size=MICRO_BATCH,
                                 neftune_noise_alpha=NEFTUNE_ALPHA, **NEFTUNE)
    eval_loss = trainer.evaluate()["eval_loss"]
    expected, expected_eval = _neftune_reference(True, eval_rows)
    clean, _ = _neftune_reference(False, eval_rows)
    return {"losses": losses, "eval_loss": eval_loss, "noised_reference": expected,
            "noised_reference_eval": expected_eval, "clean_reference": clean}


class _EmbeddingOutputs(TrainerCallback):
    """Keeps the (noised) training outputs of `embedding`, hooked once the stage is built (after
    the NEFTune hook, so it sees the noise)."""

    def __init__(self, embedding):
        self.embedding, self.outputs = embedding, []

    def on_train_begin(self, args, state, control, **kwargs):
        def keep(module, args, output):
            if module.training and torch.is_grad_enabled():
                self.outputs.append(output.detach().clone())

        self.embedding.register_forward_hook(keep)


def neftune_tp2() -> dict:
    """At tp2: how many noised embedding outputs were kept, whether both TP ranks' were equal,
    and the replicated parameters that differ between the TP ranks after training."""
    merak.init(dp=1, tp=2, pp=1)
    with merak.init_empty_weights():
        model = build("llama")
    kept = _EmbeddingOutputs(model.get_input_embeddings())
    args = merak.MerakArguments(
        output_dir=str(Path(os.environ["MERAK_TRAINER_OUT"]) / "neftune-tp2"),
        parallel_vocab=True, neftune_noise_alpha=NEFTUNE_ALPHA, **{**SHORT, **NEFTUNE})
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 callbacks=[kept])
    trainer.train()
    mine = torch.stack(kept.outputs)
    theirs = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(theirs, mine)
    replicated = [(n, p.detach()) for n, p in trainer.stage.named_parameters()
                  if getattr(p, "tp_shard", None) is None]
    differ = []
    for name, param in replicated:
        both = [torch.empty_like(param) for _ in range(2)]
        dist.all_gather(both, param.contiguous())
        if not torch.equal(both[0], both[1]):
            differ.append(name)
    return {"kept": len(kept.outputs),
            "expected_kept": SHORT["max_steps"] * SHORT["gradient_accumulation_steps"],
            "same_noise": torch.equal(theirs[0], theirs[1]), "replicated": len(replicated),
            "replicated_differ": differ}


if __name__ == "__main__":
    run_scenarios({"fp16-overflow": fp16_overflow,
                   **{f"pp2-{run}": (lambda r=run: pp2_run(r)) for run in PP2_RUNS},
                   "label-smoothing-vocab-parallel": label_smoothing_vocab_parallel,
                   "torch-compile-pp2": torch_compile_pp2, "neftune-pp2": neftune_pp2,
                   "neftune-tp2": neftune_tp2, **trainer_fields.SCENARIOS})
