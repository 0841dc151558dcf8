"""fp8 (torchao float8 linears, emulated on CPU) through `build_engine` at (dp1 pp2) and
(dp2 pp1): every step's loss, every gradient and the final weights against a single-process
model converted the same way (`merak.engine.fp8.convert_`) and trained on the same
micro-batches (fp8's dynamic scales are per matmul, so the reference runs each micro-batch on
its own, accumulating gradients, as the pipeline does). The scenarios return their figures
(`trained_like`), which test_fp8 compares."""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import transformers as tf
from common import GradSnapshot, run_scenarios, trained_like
from hf_models import LLAMA_LIKE, VOCAB

import merak
from merak.engine.assemble import build_engine
from merak.engine.fp8 import convert_
from merak.engine.options import EngineOptions, PrecisionOptions
from merak.runtime.options import RuntimeOptions
from merak.tensor_parallel.plans.options import TensorParallelOptions

STEPS, MICROBATCHES, ROWS, SEQ, LR, SEED = 3, 2, 2, 16, 0.05, 1234
RECIPES = ("tensorwise", "rowwise")


def make_llama():
    """A tiny Llama whose linears all divide by 16 (hidden 64, MLP 128, k/v 32)."""
    config = tf.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=2, **LLAMA_LIKE)
    return tf.AutoModelForCausalLM.from_config(config)


def rows(step: int, count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(2, VOCAB, (count, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def cut(batch: dict, parts: int) -> list[dict]:
    return [{k: v.chunk(parts)[i] for k, v in batch.items()} for i in range(parts)]


def reference(recipe: str, steps: list[list[dict]], autocast: torch.dtype | None = None):
    """The single-process fp8 model trained with SGD, each step over its micro-batches one at a
    time (loss / micro-batches, gradients accumulated): the steps' mean losses, gradients and
    the final parameters."""
    torch.manual_seed(SEED)
    model = make_llama().train()
    convert_(model, recipe, emulate=True)
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for microbatches in steps:
        total = 0.0
        for data in microbatches:
            with torch.autocast("cpu", autocast) if autocast is not None else nullcontext():
                loss = model(**data).loss
            (loss / len(microbatches)).backward()
            total += loss.item() / len(microbatches)
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in params.items()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in params.items()}


def _engine(recipe: str | None, ctx, microbatch: dict, make_optimizer, autocast=None,
            recompute: float = 0.0, sequence_parallel: bool = False, hooks=None):
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = make_llama()
    options = EngineOptions(pipeline=RuntimeOptions(num_microbatches=MICROBATCHES,
                                                    recompute_ratio=recompute),
                            tensor_parallel=TensorParallelOptions(
                                sequence_parallel=sequence_parallel),
                            precision=PrecisionOptions(fp8=recipe, autocast_dtype=autocast))
    return build_engine(model, microbatch, ctx, options, make_optimizer=make_optimizer,
                        stage_hooks=hooks)


def _this_rank(stage, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's `tensors` as this rank holds them: its TP shard of a sharded one."""
    own = dict(stage.named_parameters())
    spec = {n: getattr(own.get(n), "tp_shard", None) for n in tensors}
    return {n: t if spec[n] is None else spec[n].take(t) for n, t in tensors.items()}


def trains_like_one_process(recipe: str, dp: int, pp: int, autocast: torch.dtype | None = None,
                            recompute: float = 0.0, tp: int = 1,
                            sequence_parallel: bool = False) -> dict:
    ctx = merak.init(dp=dp, tp=tp, pp=pp)
    global_rows = ROWS * MICROBATCHES * dp
    batches = [rows(step, global_rows) for step in range(STEPS)]
    mine = [cut(b, dp)[ctx.dp_rank] for b in batches]  # this dp rank's rows
    snapshots = []

    def snapshot(stage):
        snapshots.append(GradSnapshot(stage))
        return snapshots

    engine = _engine(recipe, ctx, cut(mine[0], MICROBATCHES)[0],
                     lambda s: torch.optim.SGD(s.parameters(), lr=LR), autocast, recompute,
                     sequence_parallel, snapshot)
    assert engine.fp8 is not None and engine.fp8.converted, engine.fp8
    assert all(type(m).__name__.startswith("Float8") for n, m in engine.stage.named_modules()
               if n in engine.fp8.converted)
    assert all(not n.endswith("lm_head") for n in engine.fp8.converted), engine.fp8.converted
    assert ("lm_head" in engine.fp8.kept) == ctx.is_last_pp_rank, engine.fp8.kept
    if tp > 1:  # Merak's column- and row-parallel linears, in float8
        kinds = {type(m).__name__ for n, m in engine.stage.named_modules()
                 if n in engine.fp8.converted}
        assert kinds == {"Float8ColumnParallelLinear", "Float8RowParallelLinear"}, kinds
    if recompute:
        assert any(engine.interpreter.segments), engine.interpreter.segments  # blocks recomputed
    losses = [engine.interpreter.train_step(b) for b in mine]
    # the reference's micro-batches: each dp rank's, in turn (the dp all-reduce averages them)
    steps = [[mb for r in range(dp) for mb in cut(cut(b, dp)[r], MICROBATCHES)]
             for b in batches]
    ref_losses, ref_grads, ref_final = reference(recipe, steps, autocast)
    ref_grads = [_this_rank(engine.stage, g) for g in ref_grads]
    return trained_like(losses, snapshots[0], engine.stage, ref_losses, ref_grads,
                        _this_rank(engine.stage, ref_final))


def twenty_steps(dp: int, tp: int, pp: int) -> dict:
    """20 AdamW steps (lr 3e-3, 4 batches repeated, micro-batches of 4 rows at every layout:
    a dynamic scale depends on the rows a matmul sees) through `build_engine` in fp32 and in
    each fp8 recipe: every step's loss, for test_fp8's 1% bound."""
    ctx = merak.init(dp=dp, tp=tp, pp=pp)
    batches = [cut(rows(100 + i % 4, 4 * MICROBATCHES * dp), dp)[ctx.dp_rank]
               for i in range(20)]
    losses = {}
    for recipe in (None, *RECIPES):
        engine = _engine(recipe, ctx, cut(batches[0], MICROBATCHES)[0],
                         lambda s: torch.optim.AdamW(s.parameters(), lr=3e-3))
        losses[str(recipe)] = [engine.interpreter.train_step(b) for b in batches]
    return {"losses": losses}


def scenario_names(world_size: int) -> list[str]:
    return list(scenarios(world_size))


def scenarios(world_size: int) -> dict:
    """At 2 ranks (dp1 pp2), (dp2 pp1) and (tp2) with each recipe, pp2 under bf16 autocast
    and with recomputation, tp2 with sequence parallelism; at 4 ranks (dp2 pp2) and (tp2 pp2);
    at 8 (dp2 tp2 pp2); and at each tp layout, 20 steps in fp32 and fp8."""
    assert world_size in (2, 4, 8), f"fp8_parity runs on 2, 4 or 8 ranks, not {world_size}"
    table = {}
    if world_size == 8:
        for recipe in RECIPES:
            table[f"llama-dp2-tp2-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(
                r, 2, 2, tp=2)
        table["llama-dp2-tp2-pp2-twenty-steps"] = lambda: twenty_steps(2, 2, 2)
        return table
    if world_size == 4:
        for recipe in RECIPES:
            table[f"llama-dp2-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 2, 2)
            table[f"llama-tp2-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(
                r, 1, 2, tp=2)
        table["llama-tp2-pp2-twenty-steps"] = lambda: twenty_steps(1, 2, 2)
        return table
    for recipe in RECIPES:
        table[f"llama-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 1, 2)
        table[f"llama-dp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 2, 1)
        table[f"llama-tp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 1, 1, tp=2)
        table[f"llama-tp2-sp-{recipe}"] = lambda r=recipe: trains_like_one_process(
            r, 1, 1, tp=2, sequence_parallel=True)
    table["llama-pp2-tensorwise-bf16"] = lambda: trains_like_one_process(
        "tensorwise", 1, 2, torch.bfloat16)
    table["llama-pp2-rowwise-recompute"] = lambda: trains_like_one_process(
        "rowwise", 1, 2, recompute=1.0)  # every block's forward run again before its backward
    table["llama-tp2-twenty-steps"] = lambda: twenty_steps(1, 2, 1)
    return table


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
