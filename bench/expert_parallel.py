"""Expert parallelism on a Qwen3-MoE shape: bytes per rank, tokens/s and the token exchange's
bytes at ep = 1, 2 and 4 (dp = 4: the ep ranks are carved from the replicas).

    .venv/bin/python bench/expert_parallel.py            # ep 1, 2, 4 (~4 min on 2 CPU cores)
    .venv/bin/python bench/expert_parallel.py --ep 1,2

For each ep one torchrun job (4 ranks, one thread each) builds the model on the meta device,
materializes each rank's stage through `build_engine` (which keeps each rank's E/ep experts)
and trains `--steps` steps of 2 micro-batches with AdamW, each replica on its own rows.
Measured on every rank:
- expert and other parameter bytes, and AdamW's state bytes, after the steps;
- tokens/s over the steps after the first;
- the bytes the token exchange sends to other ranks per step (`all_to_all_single` rows whose
  destination is another rank, forward and backward), next to the formula for uniform
  routing: ``4 x layers x (pairs per rank) x (ep - 1) / ep x hidden x 4 bytes`` (the tokens out
  and the results back, each in the forward and again, as gradients, in the backward; a pair is
  one (token, expert) choice of the router).
Printed: the mean over ranks, and the target check: expert bytes per rank within 5% of 1/ep
of ep=1's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _common import engine_options, launch_self

# Qwen3-30B-A3B's proportions (128 experts of top-8, hidden 2048), scaled to a CPU
CONFIG = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
          "moe_intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 32, "num_experts": 16,
          "num_experts_per_tok": 4, "output_router_logits": True, "router_aux_loss_coef": 0.01,
          "tie_word_embeddings": False}
ROWS, SEQ, MICROBATCHES, DP = 2, 128, 2, 4


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(steps: int, ep: int) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import merak
    from merak.data_parallel.zero1 import local_optimizer
    from merak.engine.assemble import build_engine
    from merak.expert_parallel import experts_modules

    torch.set_num_threads(1)
    ctx = merak.init(dp=DP, tp=1, pp=1, ep=ep)
    sent = [0]
    plain = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                 async_op=False):
        if input_split_sizes is not None:  # the rows (the counts go without split sizes)
            me = dist.get_group_rank(group, dist.get_rank())
            rows = sum(input_split_sizes) - input_split_sizes[me]
            sent[0] += rows * input[0].numel() * input.element_size()
        return plain(output, input, output_split_sizes, input_split_sizes, group, async_op)

    dist.all_to_all_single = counting
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**CONFIG))
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ))
    built = build_engine(model, {"input_ids": ids, "labels": ids}, ctx,
                         engine_options(num_microbatches=MICROBATCHES))
    experts = {id(p) for module in experts_modules(built.stage).values()  # (any ep, 1 too)
               for p in module.parameters(recurse=False)}
    g = torch.Generator().manual_seed(1 + ctx.dp_rank)
    times, exchanged = [], []
    for _ in range(steps):
        batch = torch.randint(0, CONFIG["vocab_size"], (ROWS * MICROBATCHES, SEQ), generator=g)
        sent[0] = 0
        start = time.perf_counter()
        built.interpreter.train_step({"input_ids": batch, "labels": batch})
        times.append(time.perf_counter() - start)
        exchanged.append(sent[0])
    params = list(built.stage.parameters())
    optimizer = local_optimizer(built.optimizer)
    expert_state = [t for p, s in optimizer.state.items() if id(p) in experts
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    other_state = [t for p, s in optimizer.state.items() if id(p) not in experts
                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    pairs = ROWS * MICROBATCHES * SEQ * CONFIG["num_experts_per_tok"]
    formula = (4 * CONFIG["num_hidden_layers"] * pairs * (ep - 1) / ep
               * CONFIG["hidden_size"] * 4)
    row = {"expert_bytes": _bytes(p for p in params if id(p) in experts),
           "other_bytes": _bytes(p for p in params if id(p) not in experts),
           "expert_optimizer": _bytes(expert_state), "other_optimizer": _bytes(other_state),
           "tokens_per_s": ROWS * MICROBATCHES * SEQ * (steps - 1) / sum(times[1:]),
           "exchanged": sum(exchanged[1:]) / (steps - 1), "formula": formula}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return {"ep": ep, "ranks": rows}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def report(runs: dict[int, dict]) -> bool:
    mib = 2**20
    print(f"Qwen3-MoE shape ({CONFIG['num_experts']} experts, top-"
          f"{CONFIG['num_experts_per_tok']}, hidden {CONFIG['hidden_size']}, "
          f"{CONFIG['num_hidden_layers']} layers), dp={DP}, {ROWS * MICROBATCHES} rows x {SEQ} "
          f"tokens per rank and step; mean over ranks")
    print(f"{'ep':>3} {'experts MiB':>12} {'x ep=1':>7} {'other MiB':>10} {'Adam experts':>13} "
          f"{'Adam other':>11} {'tokens/s':>9} {'exchange MiB':>13} {'formula MiB':>12}")
    base = runs[min(runs)]["ranks"]
    ok = True
    for ep, run in sorted(runs.items()):
        rows = run["ranks"]
        share = _mean(rows, "expert_bytes") / _mean(base, "expert_bytes")
        if min(runs) == 1:
            ok &= abs(share * ep - 1) <= 0.05
        print(f"{ep:>3} {_mean(rows, 'expert_bytes') / mib:>12.2f} {share:>7.3f} "
              f"{_mean(rows, 'other_bytes') / mib:>10.2f} "
              f"{_mean(rows, 'expert_optimizer') / mib:>13.2f} "
              f"{_mean(rows, 'other_optimizer') / mib:>11.2f} {_mean(rows, 'tokens_per_s'):>9.0f} "
              f"{_mean(rows, 'exchanged') / mib:>13.2f} {_mean(rows, 'formula') / mib:>12.2f}")
    print(f"expert bytes per rank within 5% of 1/ep of ep=1's: {'met' if ok else 'MISSED'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--ep", default="1,2,4", help="expert-parallel degrees, comma-separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the worker's ep
    args = parser.parse_args()
    if args.worker:
        import json
        from pathlib import Path

        import torch.distributed as dist

        result = worker(args.steps, args.one)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(result))
        return
    runs = {}
    for ep in (int(x) for x in args.ep.split(",")):
        sys.argv = [sys.argv[0], "--steps", str(args.steps), "--one", str(ep)]
        runs[ep], _ = launch_self(__file__, DP)
    sys.exit(0 if report(runs) else 1)


if __name__ == "__main__":
    main()
