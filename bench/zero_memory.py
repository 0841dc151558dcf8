"""Per-rank memory of ZeRO-0/1/2/3 on a Llama, and each stage's tokens/s against ZeRO-0.

    .venv/bin/python bench/zero_memory.py                 # dp=4, then dp=2 x pp=2 (~14 min CPU)
    .venv/bin/python bench/zero_memory.py --layouts 4x1   # dp=4 only

For each layout and zero_stage 0, 1, 2, 3 one torchrun job (4 ranks, one thread each) builds
the model on the meta device, materializes each rank's stage, and trains 3 steps of 2
micro-batches with AdamW. Measured on every rank:
- parameters: bytes this rank holds between steps (a ZeRO-3 shard, else the whole stage);
- gradients: bytes of ``.grad`` just before the optimizer step;
- optimizer: bytes of AdamW's state after the step;
- gathered: the largest parameter bytes one block holds when whole (what ZeRO-3 gathers);
- peak RSS of the process;
- tokens/s of the last 2 steps.
Printed: the mean over ranks next to the ideal (unsharded total of the stage / dp), and the
target check: ZeRO-3's parameters + gradients + optimizer state <= 1.1 x ideal + gathered.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import engine_options

# ~220 M parameters: big enough that per-rank bytes dominate, small enough that 4 unsharded
# ranks with AdamW (16 bytes per parameter each) fit in 24 GiB
CONFIG = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
          "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 16,
          "tie_word_embeddings": False}
ROWS, SEQ, MICROBATCHES, STEPS = 1, 64, 2, 3


def _bytes(tensors) -> int:
    from merak.data_parallel.shards import local

    return sum(local(t).numel() * t.element_size() for t in tensors)


def _whole_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(out: Path, zero: int, dp: int, pp: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import merak
    from merak.data_parallel.shards import local
    from merak.data_parallel.zero1 import local_optimizer
    from merak.engine.assemble import build_engine
    from merak.runtime.hooks import InstructionHook

    torch.set_num_threads(1)
    ctx = merak.init(dp=dp, tp=1, pp=pp)
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ))
    seen = {}

    class GradBytes(InstructionHook):
        def on_instruction_begin(self, name, action):
            if name == "optimizer_step":
                seen["grads"] = _bytes(p.grad for p in stage.parameters() if p.grad is not None)

    built = build_engine(model, {"input_ids": ids, "labels": ids}, ctx,
                         engine_options(num_microbatches=MICROBATCHES, zero_stage=zero),
                         hooks=[GradBytes()])  # AdamW at lr 1e-4 over the stage
    stage, optimizer, engine = built.stage, built.optimizer, built.interpreter
    blocks = [m for name, m in stage.named_modules() if name.endswith(tuple(
        f"layers.{i}" for i in range(CONFIG["num_hidden_layers"])))]
    # whole tensors: a ZeRO-2/3 shard's (DTensor's) numel is the whole parameter's
    gathered = max((_whole_bytes(b.parameters()) for b in blocks), default=0)
    whole = _whole_bytes(stage.parameters())
    g = torch.Generator().manual_seed(1 + ctx.dp_rank)
    times = []
    for _ in range(STEPS):
        batch = torch.randint(0, CONFIG["vocab_size"], (ROWS * MICROBATCHES, SEQ), generator=g)
        start = time.perf_counter()
        engine.train_step({"input_ids": batch, "labels": batch})
        times.append(time.perf_counter() - start)
    state = [t for s in local_optimizer(optimizer).state.values() for t in s.values()
             if torch.is_tensor(t) and t.dim() > 0]
    row = {"rank": ctx.rank, "stage": ctx.pp_rank, "whole": whole, "gathered": gathered,
           "parameters": _bytes(local(p) for p in stage.parameters()),
           "gradients": seen["grads"], "optimizer": _bytes(state),
           "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "tokens_per_s": ROWS * MICROBATCHES * SEQ * (STEPS - 1) / sum(times[1:])}
    (out / f"zero{zero}-rank{ctx.rank}.json").write_text(json.dumps(row))


def _launch(out: Path, zero: int, dp: int, pp: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run",
                    f"--nproc_per_node={dp * pp}", __file__, "--worker", str(out),
                    "--zero", str(zero), "--dp", str(dp), "--pp", str(pp)], check=True, env=env)
    return [json.loads((out / f"zero{zero}-rank{r}.json").read_text()) for r in range(dp * pp)]


def _report(dp: int, pp: int, runs: dict[int, list[dict]]) -> bool:
    mib = 2**20
    print(f"\ndp={dp} x pp={pp}: MiB per rank (mean over ranks); ideal = the stage's "
          f"parameters + gradients + AdamW state / dp; tokens/s per stage as a ratio to "
          f"zero_stage=0")
    print(f"{'zero':>4} {'params':>8} {'grads':>8} {'optim':>8} {'sum':>8} {'ideal':>8} "
          f"{'gathered':>8} {'RSS':>8} " + " ".join(f"{'tok/s s' + str(s):>10}"
                                                   for s in range(pp)))
    speed0 = {s: [r["tokens_per_s"] for r in runs[0] if r["stage"] == s] for s in range(pp)}
    ok = True
    for zero, rows in runs.items():
        def mean(key, rows=rows):
            return sum(r[key] for r in rows) / len(rows) / mib
        ideal = sum(r["whole"] * 4 for r in rows) / len(rows) / dp / mib  # p + g + 2 Adam
        total = mean("parameters") + mean("gradients") + mean("optimizer")
        ratios = []
        for s in range(pp):
            mine = [r["tokens_per_s"] for r in rows if r["stage"] == s]
            ratios.append(f"{(sum(mine) / len(mine)) / (sum(speed0[s]) / len(speed0[s])):>9.2f}x")
        print(f"{zero:>4} {mean('parameters'):>8.1f} {mean('gradients'):>8.1f} "
              f"{mean('optimizer'):>8.1f} {total:>8.1f} {ideal:>8.1f} {mean('gathered'):>8.1f} "
              f"{mean('rss'):>8.0f} " + " ".join(ratios))
        if zero == 3:
            bound = 1.1 * ideal + mean("gathered")
            ok = total <= bound
            print(f"ZeRO-3 target: {total:.1f} MiB <= 1.1 x {ideal:.1f} + {mean('gathered'):.1f}"
                  f" = {bound:.1f} MiB: {'met' if ok else 'MISSED'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=Path)
    parser.add_argument("--zero", type=int)
    parser.add_argument("--dp", type=int)
    parser.add_argument("--pp", type=int)
    parser.add_argument("--layouts", default="4x1,2x2", help="dp x pp, comma-separated")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.zero, args.dp, args.pp)
        return
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            dp, pp = (int(x) for x in layout.split("x"))
            runs = {zero: _launch(Path(tmp), zero, dp, pp) for zero in (0, 1, 2, 3)}
            ok &= _report(dp, pp, runs)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
