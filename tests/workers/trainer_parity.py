"""MerakTrainer on dp=2 x tp=2 x pp=2 (8 ranks): writes its logged losses, grad norms,
learning rates and eval loss for test_trainer to compare with the HF Trainer reference."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from common import run_scenarios
from trainer_common import (
    COMMON,
    DP,
    LAYOUTS,
    MICRO_BATCH,
    MICROBATCHES,
    PREDICTING,
    RUNS,
    RUNS_3D,
    ZERO_GRID,
    build,
    fine_tuning_eval_set,
    fine_tuning_set,
    flow_summary,
    train_set,
)

import merak
from merak.checkpoint.export import gather_full_tensors
from merak.data_parallel.shards import local
from merak.data_parallel.zero1 import local_optimizer

OUT = Path(os.environ.get("MERAK_TRAINER_OUT", "."))


def run(name: str) -> dict:
    """One of RUNS_3D; writes the logged figures for test_trainer's comparison with HF
    Trainer's, and returns what this rank saw for its test to check: ZeRO's shares, the
    training logs, the reduce-scatters inside the last backward, the planned layout, the eval
    steps, predict()'s loss, the freed sends and the generated tokens."""
    family, extra, merak_only = RUNS[name]
    auto = merak_only.get("auto_parallel", False)
    dp, tp, pp = LAYOUTS.get(name, (2, 2, 2))
    # auto_parallel: from pure data parallelism, a step's global batch given whole
    ctx = merak.init() if auto else merak.init(dp=dp, tp=tp, pp=pp)
    with merak.init_empty_weights():
        model = build(family)
    args = merak.MerakArguments(output_dir=str(OUT / name),  # the reference's global batch
                                per_device_train_batch_size=MICRO_BATCH * DP // (1 if auto
                                                                                 else dp),
                                per_device_eval_batch_size=4 * MICRO_BATCH * DP // dp,
                                parallel_vocab=True,
                                wall_clock_breakdown=True, **{**COMMON, **extra}, **merak_only)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=fine_tuning_set(),
                                 eval_dataset=fine_tuning_eval_set())
    with _reduced_in_last_backward(trainer) as reduced:
        trainer.train()
    seen = {"max_steps": args.max_steps, "reduced_in_last_backward": reduced,
            "chunks": args.num_model_chunks if args.train_schedule == "interleaved_1f1b" else 1}
    if auto:  # the layout chosen; evaluation at the reference's rows per dp rank
        ctx, dp = trainer.ctx, trainer.ctx.dp
        planned = json.loads((OUT / name / "plan.json").read_text())
        seen["planned"] = {"chosen_dp": planned["chosen"]["dp"], "dp": dp,
                           "measured": len(planned["measured"])}
        args.per_device_eval_batch_size = 4 * MICRO_BATCH * DP * MICROBATCHES // (
            dp * args.gradient_accumulation_steps)
    flow = flow_summary(trainer) if name.endswith("hf-flow") else {}
    metrics = trainer.evaluate()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    seen["logs"] = [{"tokens_per_second": h["tokens_per_second"],
                     "time_forward_ms": h["time_forward_ms"]} for h in logs]
    seen["eval_loss"] = metrics["eval_loss"]
    if name in PREDICTING:  # predictions: logits of every sample, in dataset order
        predicted = trainer.predict(fine_tuning_eval_set())
        seen["test_loss"] = predicted.metrics["test_loss"]
        if ctx.rank == 0:
            np.save(OUT / f"merak-{name}-logits.npy", predicted.predictions)
            np.save(OUT / f"merak-{name}-labels.npy", predicted.label_ids)
    trainer.args.eval_iters = 1
    if not auto:  # (the planned layout sets how many rows an evaluation step takes)
        seen["eval_steps"] = [metrics["eval_steps"], trainer.evaluate()["eval_steps"]]
    state_bytes = sum(local(t).numel() * t.element_size()  # (ZeRO-2/3: this rank's shard)
                      for s in local_optimizer(trainer.optimizer).state.values()
                      for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.stage.parameters())
    share = state_bytes / (2 * param_bytes)  # Adam keeps two tensors per parameter
    held = sum(local(p).numel() for p in trainer.stage.parameters()) / \
        sum(p.numel() for p in trainer.stage.parameters())
    zero = trainer.args.zero_stage
    if merak_only.get("dealloc_pipeoutput"):  # the sending chunks that free nothing they sent
        runners = trainer.engine.interpreter.runners
        seen["senders_freeing_nothing"] = sorted(
            s for s, r in runners.items() if s < r.split.num_stages - 1 and not r.freeable)
    if zero == 3 and name not in ZERO_GRID:  # generation gathers the shards: HF generate's
        # tokens on the trained model
        seen["generation"] = _generates_as_hf(trainer, family)
    if ctx.rank == 0:
        (OUT / f"merak-{name}.json").write_text(json.dumps({"state_share": share,
            "loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "learning_rate": [h["learning_rate"] for h in logs],
            "eval_loss": metrics["eval_loss"],
            **flow}))
    dist.barrier()
    # what this rank holds of the optimizer state and of the parameters (ZeRO's share)
    return {"zero_stage": zero, "dp": trainer.ctx.dp, "state_share": share, "params_held": held,
            **seen}


@contextlib.contextmanager
def _reduced_in_last_backward(trainer):
    """Records, for each `ZeroSharding.last_backward` of `trainer`'s sharding (the step's last
    backward of a chunk; not an auto_parallel plan's dry runs), whether every trainable shard
    of the chunk had its gradient when it ended (ZeRO-2/3 reduce-scatter there, not in the
    tail)."""
    from torch.distributed.fsdp import fully_shard

    from merak.data_parallel.zero import ZeroSharding

    original, reduced = ZeroSharding.last_backward, []

    @contextlib.contextmanager
    def recording(self, stage_id):
        with original(self, stage_id):
            yield
        if trainer.engine is None or self is not trainer.engine.zero:
            return  # (a dry run's sharding, before the trainer's engine is built)
        root = next(r for r in self.roots if r.stage_id == stage_id)
        shards = [p.sharded_param for unit in fully_shard.state(root)._state_ctx.all_states
                  for group in unit._fsdp_param_groups for p in group.fsdp_params
                  if p.sharded_param.requires_grad]  # (ZeRO-2 runs on the gathered ones)
        reduced.append(bool(shards) and all(p.grad is not None for p in shards))

    ZeroSharding.last_backward = recording
    try:
        yield reduced
    finally:
        ZeroSharding.last_backward = original


def _generates_as_hf(trainer, family: str) -> dict | None:
    """Merak's generated tokens and (rank 0) HF generate's on the gathered trained weights,
    with the names the gathered state missed and had in excess (None on other ranks)."""
    prompts = [[5, 9, 3, 7], [11, 4]]
    got = trainer.generate(prompts, max_new_tokens=4)
    full = gather_full_tensors(trainer.stage, trainer.ctx,
                               trainer.loss_choice.name_prefix)
    if trainer.ctx.rank != 0:
        return None
    reference = build(family)
    missing, unexpected = reference.load_state_dict(full, strict=False)
    reference.eval()
    wanted = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        wanted.append(reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=4, do_sample=False)[0, len(prompt):]
                      .tolist())
    return {"tokens": [list(t) for t in got], "hf_tokens": wanted, "missing": sorted(missing),
            "unexpected": sorted(unexpected)}


def hf_api() -> dict:
    """HF Trainer's API on a dp2 x tp2 x pp2 job: save_model (an HF directory gathered from the
    shards; test_trainer loads it and evaluates it with HF Trainer), save_state, metrics files,
    model card, and a partial last eval batch with preprocess_logits_for_metrics and
    compute_metrics (also checked against HF Trainer there); neither the export nor the
    evaluation calls a torch object collective (GPU staging under NCCL). Returns what test_trainer
    checks: the arguments' ranks and roles, the eval steps and logits' shapes, and (rank 0) the
    files written, the state's step and how the saved model compares with `merak export`'s."""
    import transformers as tf
    from trainer_common import dataset, token_accuracy

    ctx = merak.init(dp=2, tp=2, pp=2)
    with merak.init_empty_weights():
        model = build("llama")
    out = OUT / "hf-api"
    args = merak.MerakArguments(output_dir=str(out), per_device_train_batch_size=MICRO_BATCH,
                                per_device_eval_batch_size=3, parallel_vocab=True,
                                **{**COMMON, "max_steps": 2, "save_steps": 2})
    seen = {"rank": ctx.rank, "process_index": args.process_index,
            "world_size": args.world_size, "should_log": args.should_log,
            "should_save": args.should_save}
    order = []
    with args.main_process_first(local=False):
        order.append(time.perf_counter())
    shapes = []

    def preprocess(logits, labels):
        shapes.append(tuple(logits.shape))
        return logits.argmax(-1)

    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 eval_dataset=dataset(21, 9), compute_metrics=token_accuracy,
                                 preprocess_logits_for_metrics=preprocess)
    trainer.train()
    from host_objects import no_object_collectives

    with no_object_collectives():  # predictions gathered through host memory
        metrics = trainer.evaluate()
    seen.update(eval_steps=metrics["eval_steps"], last_stage=ctx.is_last_pp_rank,
                logits_widths=sorted({s[-1] for s in shapes}), vocab=model.config.vocab_size)
    with no_object_collectives():  # the shards gathered one at a time through host memory
        trainer.save_model(str(out / "model"))
    trainer.save_state()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    trainer.create_model_card()
    dist.barrier()
    if ctx.rank == 0:
        (out / "merak-eval.json").write_text(json.dumps(metrics))
        seen["files"] = sorted(p.name for p in out.iterdir())
        seen["global_step"] = json.loads((out / "trainer_state.json").read_text())["global_step"]
        saved = tf.AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
        from merak.checkpoint.export import export_checkpoint

        exported = tf.AutoModelForCausalLM.from_pretrained(
            export_checkpoint(out / "checkpoint-2", out / "exported")).state_dict()
        seen["saved_names_apart"] = sorted(saved.keys() ^ exported.keys())
        seen["saved_unlike_exported"] = sorted(name for name, value in saved.items()
                                               if name in exported
                                               and not torch.equal(value, exported[name]))
    dist.barrier()
    return seen


if __name__ == "__main__":
    run_scenarios({**{f"trainer-{r}": (lambda r=r: run(r)) for r in RUNS_3D},
                   "hf-api": hf_api})
