"""Peak memory of building a big model on the meta device and loading only each rank's stage.

    .venv/bin/python bench/meta_load.py            # ~6 GB of disk under /tmp, a few minutes
    .venv/bin/python bench/meta_load.py --layers 4 --hidden 256   # a quick look

1. Saves a Llama (24 layers, hidden 2048, ~1.35 B parameters, fp32) as HF safetensors.
2. Launches 4 ranks (pp=4): each builds the model inside `merak.init_empty_weights()` and its
   engine through `build_engine` (bench/_common.py), which splits the model, materializes only
   this rank's stage and loads only its own tensor names; prints peak RSS after the build and
   after one pipelined forward/backward.
3. Baseline in one process: the HF constructor + `load_state_dict` of the whole checkpoint.
Target: each rank's peak after load <= 1.5 x its own parameter bytes + 600 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _common import RESULTS, build

CONFIG = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5504,
          "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
          "tie_word_embeddings": False}
MB = 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def config():
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def save_checkpoint(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config())
    model.save_pretrained(path, max_shard_size="2GB")
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters to {path}")


def baseline(path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config())
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    model.load_state_dict(state)
    print(json.dumps({"baseline_peak_mb": peak_rss_mb(),
                      "param_mb": sum(p.numel() * 4 for p in model.parameters()) / MB}))


def rank_main(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    import merak

    ctx = merak.init(dp=1, tp=1, pp=4)
    with merak.init_empty_weights():
        model = AutoModelForCausalLM.from_config(config())
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 128))
    built = build(model, {"input_ids": ids, "labels": ids.clone()}, ctx,
                  lambda stage: torch.optim.SGD(stage.parameters(), lr=0.0), checkpoint=path,
                  num_microbatches=1)
    own_mb = sum(p.numel() * p.element_size() for p in built.stage.parameters()) / MB
    after_load = peak_rss_mb()
    built.interpreter.train_step({"input_ids": ids, "labels": ids.clone()})
    row = {"rank": ctx.rank, "own_param_mb": own_mb, "peak_after_load_mb": after_load,
           "peak_after_step_mb": peak_rss_mb(), "target_mb": 1.5 * own_mb + 600}
    rows = [None] * ctx.world_size
    torch.distributed.all_gather_object(rows, row)
    if ctx.rank == 0:
        print(json.dumps(rows))
    torch.distributed.destroy_process_group()


def run(*args: str) -> str:
    env = dict(os.environ, MERAK_META_LOAD_CONFIG=json.dumps(CONFIG))
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False,
                         env=env)
    if out.returncode:
        raise SystemExit(f"{' '.join(args[:4])} failed:\n{out.stderr[-4000:]}")
    return out.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "rank", "baseline"])
    parser.add_argument("--path")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=CONFIG["hidden_size"],
                        help="hidden size (the MLP 2.6875x, 128 per head)")
    parser.add_argument("--save", default=str(RESULTS / "meta_load.json"),
                        help="where the figures go (JSON; default %(default)s)")
    args = parser.parse_args()
    CONFIG.update(json.loads(os.environ.get("MERAK_META_LOAD_CONFIG", "{}")))
    if args.phase is None:  # the phases get the sizes through the environment (`run`)
        CONFIG.update(num_hidden_layers=args.layers, hidden_size=args.hidden,
                      intermediate_size=int(args.hidden * 2.6875),
                      num_attention_heads=max(1, args.hidden // 128),
                      num_key_value_heads=max(1, args.hidden // 128))
    if args.phase == "save":
        return save_checkpoint(Path(args.path))
    if args.phase == "rank":
        return rank_main(Path(args.path))
    if args.phase == "baseline":
        return baseline(Path(args.path))
    with tempfile.TemporaryDirectory() as tmp:
        print(run(__file__, "--phase", "save", "--path", tmp).strip())
        ranks = json.loads(run("-m", "torch.distributed.run", "--nproc_per_node", "4",
                               __file__, "--phase", "rank", "--path", tmp).strip().splitlines()[-1])
        base = json.loads(run(__file__, "--phase", "baseline", "--path", tmp).strip()
                          .splitlines()[-1])
    print(f"{'rank':>4} {'own params MB':>14} {'peak after load':>16} {'after fwd/bwd':>14} "
          f"{'target':>8}  ok")
    for r in ranks:
        ok = r["peak_after_load_mb"] <= r["target_mb"]
        print(f"{r['rank']:>4} {r['own_param_mb']:>14.0f} {r['peak_after_load_mb']:>16.0f} "
              f"{r['peak_after_step_mb']:>14.0f} {r['target_mb']:>8.0f}  {'yes' if ok else 'NO'}")
    print(f"baseline (HF constructor + load_state_dict, one process): peak "
          f"{base['baseline_peak_mb']:.0f} MB for {base['param_mb']:.0f} MB of parameters")
    worst = max(r["peak_after_load_mb"] for r in ranks)
    print(f"largest rank peak / baseline peak: {worst / base['baseline_peak_mb']:.2f}")
    Path(args.save).write_text(json.dumps({"config": CONFIG, "ranks": ranks, "baseline": base},
                                          indent=1))
    print(f"figures written to {args.save}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
