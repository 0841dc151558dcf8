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


def trains_like_one_process(recipe: str, dp: int, pp: int,
                            autocast: torch.dtype | None = None, recompute: float = 0.0) -> dict:
    ctx = merak.init(dp=dp, tp=1, pp=pp)
    global_rows = ROWS * MICROBATCHES * dp
    batches = [rows(step, global_rows) for step in range(STEPS)]
    mine = [cut(b, dp)[ctx.dp_rank] for b in batches]  # this dp rank's rows
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = make_llama()
    snapshots = []

    def snapshot(stage):
        snapshots.append(GradSnapshot(stage))
        return snapshots

    options = EngineOptions(pipeline=RuntimeOptions(num_microbatches=MICROBATCHES,
                                                    recompute_ratio=recompute),
                            precision=PrecisionOptions(fp8=recipe, autocast_dtype=autocast))
    engine = build_engine(model, cut(mine[0], MICROBATCHES)[0], ctx, options,
                          make_optimizer=lambda s: torch.optim.SGD(s.parameters(), lr=LR),
                          stage_hooks=snapshot)
    assert engine.fp8 is not None and engine.fp8.converted, engine.fp8
    assert all(type(m).__name__ == "Float8Linear" for n, m in engine.stage.named_modules()
               if n in engine.fp8.converted)
    assert all(not n.endswith("lm_head") for n in engine.fp8.converted), engine.fp8.converted
    assert ("lm_head" in engine.fp8.kept) == ctx.is_last_pp_rank, engine.fp8.kept
    if recompute:
        assert any(engine.interpreter.segments), engine.interpreter.segments  # blocks recomputed
    losses = [engine.interpreter.train_step(b) for b in mine]
    # the reference's micro-batches: each dp rank's, in turn (the dp all-reduce averages them)
    steps = [[mb for r in range(dp) for mb in cut(cut(b, dp)[r], MICROBATCHES)]
             for b in batches]
    ref_losses, ref_grads, ref_final = reference(recipe, steps, autocast)
    return trained_like(losses, snapshots[0], engine.stage, ref_losses, ref_grads, ref_final)


def scenario_names(world_size: int) -> list[str]:
    return list(scenarios(world_size))


def scenarios(world_size: int) -> dict:
    """At 2 ranks (dp1 pp2) and (dp2 pp1) with each recipe, and pp2 under bf16 autocast and
    with recomputation; at 4
    ranks (dp2 pp2). tp > 1 is refused with fp8 (merak.engine.fp8)."""
    assert world_size in (2, 4), f"fp8_parity runs on 2 or 4 ranks, not {world_size}"
    table = {}
    if world_size == 4:
        for recipe in RECIPES:
            table[f"llama-dp2-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 2, 2)
        return table
    for recipe in RECIPES:
        table[f"llama-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 1, 2)
        table[f"llama-dp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 2, 1)
    table["llama-pp2-tensorwise-bf16"] = lambda: trains_like_one_process(
        "tensorwise", 1, 2, torch.bfloat16)
    table["llama-pp2-rowwise-recompute"] = lambda: trains_like_one_process(
        "rowwise", 1, 2, recompute=1.0)  # every block's forward run again before its backward
    return table


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
