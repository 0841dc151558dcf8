"""Pipelined generation against HF `generate`, and LoRA's per-rank training memory.

    .venv/bin/python bench/generate.py            # 2 ranks (pp=2), about two minutes on CPU

1. Decode speed: a ~35 M-parameter Llama built on the meta device and split into 2 stages
   (2 ranks, one thread each) generates greedily for 8 prompts of 16-48 tokens with
   `merak.generate` (KV cache per stage); rank 0 then runs HF ``generate`` (KV cache) on the
   single-process model with the same weights, prompts and padding, one thread. Printed: decode
   tokens/s of each, their ratio, per-token latency, and whether the tokens are equal. The
   pipeline's ranks compute one after another within a step (no micro-batching in decode), so
   the ratio measures what pipelining costs per token (two hops, the logits broadcast), not a
   speed-up: pipelining serves models one device cannot hold.
2. Memory: per rank, trainable parameters and AdamW state bytes after one training step, for
   full fine-tuning and for LoRA (r=8 on q/k/v/o and the MLP projections) of the same stage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import engine_options

CONFIG = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
          "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
          "tie_word_embeddings": False}
LENGTHS = (16, 24, 32, 40, 48, 20, 28, 36)
NEW_TOKENS, SEED = 32, 0
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]}


def _model(meta: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    import merak

    torch.manual_seed(SEED)
    if not meta:
        return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    with merak.init_empty_weights():
        return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]


def _timed(fn) -> tuple[object, float]:
    fn()  # warm-up (first-call allocations)
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _hf_generate(model) -> list[list[int]]:
    from merak.generation.generate import left_padded, new_tokens

    ids, mask = left_padded(_prompts(), 0, "cpu")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0)
    eos = {model.generation_config.eos_token_id}
    return [new_tokens(row, eos) for row in out[:, ids.shape[1]:]]


def _train_memory(ctx, lora: bool) -> dict:
    from merak import lora as merak_lora
    from merak.engine.assemble import build_engine

    model = _model(meta=True)
    if lora:
        model = merak_lora.wrap(model, json.dumps(LORA))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 32))
    built = build_engine(model, {"input_ids": ids, "labels": ids}, ctx,
                         engine_options(num_microbatches=2),
                         make_optimizer=lambda stage: torch.optim.AdamW(
                             [p for p in stage.parameters() if p.requires_grad], lr=1e-4))
    stage, optimizer, engine = built.stage, built.optimizer, built.interpreter
    trainable = [p for p in stage.parameters() if p.requires_grad]
    rows = torch.cat([ids, ids])  # two micro-batches of the traced shape
    engine.train_step({"input_ids": rows, "labels": rows})
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                for t in s.values() if isinstance(t, torch.Tensor))
    return {"trainable": sum(p.numel() for p in trainable),
            "all": sum(p.numel() for p in stage.parameters()), "optimizer_bytes": state}


def rank_main(out: Path) -> None:
    import torch.distributed as dist

    import merak

    torch.set_num_threads(1)
    ctx = merak.init(dp=1, tp=1, pp=2)
    model = _model(meta=True)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 32))
    stage = merak.parallelize(model, {"input_ids": ids, "labels": ids}, ctx)
    ours, seconds = _timed(lambda: merak.generate(
        model, stage, _prompts(), ctx=ctx, max_new_tokens=NEW_TOKENS, pad_token_id=0))
    result = {"merak_s": seconds, "merak_tokens": ours}
    dist.barrier()
    if ctx.rank == 0:
        reference = _model(meta=False).eval()
        theirs, seconds = _timed(lambda: _hf_generate(reference))
        result.update(hf_s=seconds, hf_tokens=theirs)
    dist.barrier()
    result["memory"] = {"full": _train_memory(ctx, lora=False),
                        "lora": _train_memory(ctx, lora=True)}
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_out:
        return rank_main(Path(args.rank_out))
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        __file__, "--rank-out", tmp], check=True, env=env)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    first = ranks[0]
    tokens = len(LENGTHS) * NEW_TOKENS
    merak_rate, hf_rate = tokens / first["merak_s"], tokens / first["hf_s"]
    print(f"generation, {len(LENGTHS)} prompts x {NEW_TOKENS} new tokens, greedy, KV cache:")
    print(f"  merak pp=2 (2 ranks): {merak_rate:8.1f} tokens/s, "
          f"{1000 * first['merak_s'] / NEW_TOKENS:6.1f} ms per decode step of the batch")
    print(f"  HF generate (1 process): {hf_rate:8.1f} tokens/s, "
          f"{1000 * first['hf_s'] / NEW_TOKENS:6.1f} ms per decode step of the batch")
    print(f"  ratio merak / HF: {merak_rate / hf_rate:.2f}x; tokens equal: "
          f"{first['merak_tokens'] == first['hf_tokens']}")
    print("training memory per rank (pp=2), after one AdamW step:")
    for rank, data in enumerate(ranks):
        full, lora = data["memory"]["full"], data["memory"]["lora"]
        print(f"  rank {rank}: full fine-tuning {full['trainable'] / 1e6:6.2f} M trainable, "
              f"AdamW {full['optimizer_bytes'] / 2**20:7.1f} MiB | LoRA r={LORA['r']} "
              f"{lora['trainable'] / 1e6:6.3f} M trainable of {lora['all'] / 1e6:.2f} M, "
              f"AdamW {lora['optimizer_bytes'] / 2**20:6.2f} MiB "
              f"({full['optimizer_bytes'] / max(lora['optimizer_bytes'], 1):.0f}x less)")


if __name__ == "__main__":
    main()
