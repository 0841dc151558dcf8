"""Generation with expert parallelism (see test_expert_parallel_generation): the tiny Qwen3-MoE
of ep_parity built by `build_engine` at dp2 ep2 (2 ranks; ZeRO-3 too) and dp2 ep2 pp2 (4 ranks;
dp4 ep2 too with MERAK_TEST_MATRIX=full) decodes with `merak.generate`; the ranks of an ep group
decode different prompts in lockstep. Each scenario returns what every rank generated, per
request, for the test to compare with single-process HF `generate` on each dp rank's share of
the prompts.

The requests: `PROMPTS` (lengths 3, 7 and 5) greedy with an eos token that ends the first
prompt's generation early (`early_eos`: a token HF's greedy output of that prompt holds early
and the others' do not), so the dp rank holding it is done first and keeps stepping; the first
prompt alone (the other dp ranks have none and decode a placeholder); and the three prompts
sampled with a seed."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from ep_parity import OPTIMIZERS, _reference

import merak
from merak.engine.assemble import build_engine
from merak.engine.options import EngineOptions, PrecisionOptions
from merak.runtime.options import RuntimeOptions

NEW_TOKENS, SEED = 8, 5
PROMPTS = [[5, 17, 33], [9, 40, 2, 71, 13, 8, 99], [61, 3, 27, 45, 6]]


def moe_model():
    """ep_parity's tiny Qwen3-MoE (seeded) without router logits: transformers' load-balancing
    loss does not take a decode step's one position (its mask spans the cache)."""
    model = _reference("qwen3_moe")
    model.config.output_router_logits = False
    return model


def early_eos(model) -> int:
    """A token greedy HF decoding of prompt 0 emits at its 2nd or 3rd new token and never in
    the other prompts' first `NEW_TOKENS`: with it as eos prompt 0 ends first."""
    outs = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
            for p in PROMPTS]
    others = {t for out in outs[1:] for t in out}
    return next(t for t in outs[0][1:3] if t not in others and t not in outs[0][:1])


def requests(eos: int) -> dict[str, dict]:
    """Each request's `merak.generate` arguments (the same for the HF reference)."""
    return {"greedy-early-eos": {"prompts": PROMPTS, "eos_token_id": eos},
            "greedy-one-prompt": {"prompts": PROMPTS[:1], "eos_token_id": eos},
            "sampled": {"prompts": PROMPTS, "do_sample": True, "temperature": 0.8,
                        "top_k": 20, "seed": SEED, "eos_token_id": None}}


def generated(dp: int, pp: int, zero: int = 0) -> dict:
    """Build the engine at dp x pp with ep2 (`zero`: its ZeRO stage; ZeRO-3 decodes inside
    `gathered`, as `MerakTrainer.generate` does) and run every request."""
    ctx = merak.init(dp=dp, tp=1, pp=pp, ep=2)
    eos = early_eos(moe_model())
    with merak.init_empty_weights():
        model = moe_model()  # (seeded: materialized as the reference initializes)
    options = EngineOptions(pipeline=RuntimeOptions(num_microbatches=2),
                            precision=PrecisionOptions(zero_stage=zero))
    example = {"input_ids": torch.ones(2, 8, dtype=torch.long),
               "labels": torch.ones(2, 8, dtype=torch.long)}
    built = build_engine(model, example, ctx, options,
                         make_optimizer=lambda stage: OPTIMIZERS["sgd"](stage.parameters()))
    out = {}
    for name, request in requests(eos).items():
        with built.zero.gathered() if built.zero is not None else contextlib.nullcontext():
            out[name] = merak.generate(model, built.stage, ctx=ctx, max_new_tokens=NEW_TOKENS,
                                       **request)
    experts = [p for p in built.stage.parameters() if getattr(p, "expert_parallel", False)]
    return {"generated": out, "eos": eos, "dp": dp, "ep_rank": ctx.ep_rank,
            "experts_held": sum(p.numel() for p in experts), "rank": dist.get_rank()}


def scenarios(world_size: int) -> dict:
    if world_size == 2:
        return {"generate-qwen3_moe-dp2-ep2": lambda: generated(2, 1),
                "generate-qwen3_moe-dp2-ep2-zero3": lambda: generated(2, 1, zero=3)}
    if world_size == 4:  # (dp4: one rank has none of the 3 prompts; MERAK_TEST_MATRIX=full)
        out = {"generate-qwen3_moe-dp2-ep2-pp2": lambda: generated(2, 2)}
        if os.environ.get("MERAK_TEST_MATRIX") == "full":
            out["generate-qwen3_moe-dp4-ep2"] = lambda: generated(4, 1)
        return out
    return {}


if __name__ == "__main__":
    from common import run_scenarios

    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
