"""Per-rank parameter + optimizer-state bytes of a Llama under dp x tp x pp layouts.

    .venv/bin/python bench/tp_memory.py            # 8 ranks per layout, a few minutes
    .venv/bin/python bench/tp_memory.py --layouts 1x2x1 --layers 2   # a quick look

For each layout, the ranks build the model on the meta device and their engine through
`build_engine` (bench/_common.py): tensor parallelism (`parallel_vocab=True`), the split into
pp stages (`partition_method="parameters"`), their own stage materialized; then one Adam step.
Each rank reports its parameter bytes and Adam state bytes; the bench prints them as a ratio to
the unsharded model's (parameters + Adam state), next to the ideal 1/(tp*pp), and lists what
stays replicated (norm weights).
Target: every rank within 5% of 1/(tp*pp), plus its replicated bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _common import RESULTS, build, free_port

CONFIG = {"vocab_size": 34112, "hidden_size": 1024, "intermediate_size": 2816,
          "num_hidden_layers": 14, "num_attention_heads": 16, "num_key_value_heads": 8,
          "tie_word_embeddings": False}
# the embedding and the LM head are each about three layers: 20 equal units, so pp=2 and pp=4
# can be balanced exactly
LAYOUTS = [(2, 2, 2), (1, 4, 2), (1, 8, 1), (1, 2, 4)]  # (dp, tp, pp), 8 ranks each
MB = 2**20


def model_from_meta():
    from transformers import AutoModelForCausalLM, LlamaConfig

    import merak

    with merak.init_empty_weights():
        return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))


def rank_main(out: Path, dp: int, tp: int, pp: int) -> None:
    import merak

    torch.set_num_threads(1)
    ctx = merak.init(dp=dp, tp=tp, pp=pp)
    model = model_from_meta()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    built = build(model, {"input_ids": ids, "labels": ids}, ctx,
                  lambda stage: torch.optim.Adam(stage.parameters(), lr=1e-4),
                  parallel_vocab=True, partition_method="parameters", num_microbatches=1)
    stage, optimizer = built.stage, built.optimizer
    built.interpreter.train_step({"input_ids": ids, "labels": ids})
    params = {id(p): p for p in stage.parameters()}.values()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                      for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    replicated = sum(p.numel() * p.element_size() for p in params
                     if getattr(p, "tp_shard", None) is None)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({
        "rank": ctx.rank, "stage": ctx.pp_rank, "tp_rank": ctx.tp_rank, "full": full_bytes,
        "params": param_bytes, "adam": state_bytes, "replicated": replicated}))


def report(dp: int, tp: int, pp: int, rows: list[dict]) -> bool:
    ideal = 1 / (tp * pp)
    print(f"\ndp={dp} tp={tp} pp={pp}: ideal share 1/(tp*pp) = {ideal:.4f}")
    print("rank stage  params MB  adam MB  (params+adam)/unsharded  / ideal  replicated MB  ok")
    all_ok = True
    for r in sorted(rows, key=lambda r: r["rank"]):
        share = (r["params"] + r["adam"]) / (3 * r["full"])  # Adam keeps 2 states per weight
        sharded_share = (r["params"] - r["replicated"]) / r["full"]
        ok = abs(sharded_share / ideal - 1) <= 0.05
        all_ok &= ok
        print(f"{r['rank']:4d} {r['stage']:5d} {r['params'] / MB:10.1f} {r['adam'] / MB:8.1f} "
              f"{share:24.4f} {share / ideal:7.3f} {r['replicated'] / MB:14.3f}  "
              f"{'yes' if ok else 'NO'}")
    return all_ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-main", nargs=3, type=int, metavar=("DP", "TP", "PP"))
    parser.add_argument("--out")
    parser.add_argument("--layouts", nargs="+", default=[f"{d}x{t}x{p}" for d, t, p in LAYOUTS],
                        help="dp x tp x pp layouts (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--save", default=str(RESULTS / "tp_memory.json"),
                        help="where the rows go (JSON; default %(default)s)")
    args = parser.parse_args()
    CONFIG["num_hidden_layers"] = args.layers
    if args.rank_main:
        rank_main(Path(args.out), *args.rank_main)
        return
    unsharded = sum(p.numel() * 4 for p in model_from_meta().parameters())
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, vocab "
          f"{CONFIG['vocab_size']}: {unsharded / MB:.0f} MB of fp32 parameters, "
          f"{3 * unsharded / MB:.0f} MB with Adam state")
    results, every = {}, {}
    for dp, tp, pp in (tuple(map(int, layout.split("x"))) for layout in args.layouts):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                   str(dp * tp * pp), f"--master_port={free_port()}", __file__, "--rank-main",
                   str(dp), str(tp), str(pp), "--out", tmp, "--layers", str(args.layers)]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            rows = [json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")]
            if proc.returncode or len(rows) != dp * tp * pp:
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                raise SystemExit(f"layout dp={dp} tp={tp} pp={pp} failed")
            results[(dp, tp, pp)] = report(dp, tp, pp, rows)
            every[f"dp{dp}-tp{tp}-pp{pp}"] = rows
    print("\nsharded parameters within 5% of 1/(tp*pp) on every rank: "
          + ", ".join(f"dp{d}-tp{t}-pp{p} {'yes' if ok else 'NO'}"
                      for (d, t, p), ok in results.items()))
    Path(args.save).write_text(json.dumps({"config": CONFIG, "layouts": every}, indent=1))
    print(f"rows written to {args.save}")


if __name__ == "__main__":
    main()
