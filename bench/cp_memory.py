"""Memory and time per rank under context parallelism at the lengths it exists for: one row of
8k, 16k and 32k tokens, cp = 1, 2 and 4, ring and Ulysses, as a user sees them.

    .venv/bin/python bench/cp_memory.py                 # 8192 16384 32768 tokens
    .venv/bin/python bench/cp_memory.py --seqs 4096     # a quick look

A Llama of 2 blocks (hidden 512, 8 query heads, 2 key/value heads, head dim 64, vocabulary
4096, sdpa attention) is built on the meta device, assembled by `build_engine` (bench/_common.py)
and trained one step (forward and backward of one row, SGD), on cp ranks launched by torchrun
(cp = 1: one process over the whole row, plain sdpa; cp = 2, 4: each rank holds its
load-balanced share, attention wrapped as ring or Ulysses). Each rank reports:

- peak RSS growth: the kernel's high-water mark of the process (``VmHWM``, reset through
  ``/proc/self/clear_refs`` after the model is built) minus its RSS before the step: every
  transient the step allocates, which is what runs a machine out of memory;
- the saved-tensor peak of the activation meter (what the planner's dry runs count), beside it;
- the step's wall time. The machine's cores are shared the same way in every run (cp = 1 uses
  them all; cp ranks one thread each), so time per token of the whole row compares the split's
  cost with not splitting, on the same hardware.

Targets (benchmark, not tests): peak growth per rank at cp=2 <= 0.6x of cp=1's, at cp=4 <=
0.35x; time per token within 1.2x of cp=1's. The largest row that fits in 20 GiB per rank is
extrapolated from the two longest rows (growth is linear in the length once no (S x S) or
(chunk x chunk) tensor exists).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, ROOT, build, free_port

CONFIG = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}
TARGETS = {2: 0.6, 4: 0.35}
TIME_TARGET = 1.2
BUDGET = 20 * 2**30


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Give freed heap back to the system (a previous run's blocks would otherwise hide this
    run's growth), then make the high-water mark the current RSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def measure(seq: int, cp: int, mode: str | None) -> dict:
    """One training step of one row of `seq` tokens on this rank."""
    import torch
    import transformers as tf

    import merak
    from merak.context_parallel import enable_context_parallel, split_batch

    ctx = merak.init(dp=1, tp=1, pp=1, cp=cp)
    config = tf.LlamaConfig(**CONFIG)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor([seq - 1])}
    if cp > 1:
        enable_context_parallel(model, ctx.cp_group, mode)
        batch = split_batch(batch, cp, ctx.cp_rank)
    built = build(model, batch, ctx, lambda stage: torch.optim.SGD(stage.parameters(), lr=0.0),
                  num_microbatches=1, measure_activations=True)
    engine, stage = built.interpreter, built.stage
    engine.loss_weight = 1.0  # the model divides by the row's token count
    _reset_peak()
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    engine.train_step(batch)
    took = time.perf_counter() - start
    growth = (_status_kib("VmHWM") - before) * 1024
    result = {"seq": seq, "cp": cp, "mode": mode or "none", "peak_growth": growth,
              "saved": engine.activation_peak, "seconds": took}
    del engine, stage, built, model
    return result


def worker(cli) -> None:
    import torch
    import torch.distributed as dist

    cp = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    rows = []
    for seq in cli.seqs:
        for mode in ((None,) if cp == 1 else ("ring", "ulysses")):
            mine = measure(seq, cp, mode)
            every = [None] * cp
            dist.all_gather_object(every, mine)
            rows.append({**mine, "peak_growth": max(r["peak_growth"] for r in every),
                         "saved": max(r["saved"] for r in every),
                         "seconds": max(r["seconds"] for r in every)})
            if dist.get_rank() == 0:
                print(f"  cp={cp} {mine['mode']:8} {seq:6} tokens: peak growth "
                      f"{rows[-1]['peak_growth'] / 2**30:.3f} GiB, "
                      f"{rows[-1]['seconds']:.1f} s", flush=True)
    if dist.get_rank() == 0:
        Path(cli.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def launch(cp: int, seqs: list[int]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run",
                        f"--nproc_per_node={cp}", f"--master_port={free_port()}", __file__,
                        "--worker", "--out", str(out), "--seqs", *map(str, seqs)],
                       env=env, check=True)
        return json.loads(out.read_text())


def report(rows: list[dict]) -> None:
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    print(f"\none row, Llama {CONFIG['num_hidden_layers']} blocks x hidden "
          f"{CONFIG['hidden_size']}, 8 heads / 2 KV heads, one training step, per rank:")
    print(f"{'tokens':>7} {'layout':14}{'peak GiB':>9}{'vs cp=1':>8}{'saved GiB':>10}"
          f"{'s/step':>8}{'t/token vs cp=1':>17}")
    verdicts = []
    for r in sorted(rows, key=lambda r: (r["seq"], r["cp"], r["mode"])):
        one = base[r["seq"]]
        ratio = r["peak_growth"] / one["peak_growth"]
        speed = r["seconds"] / one["seconds"]
        layout = "cp=1" if r["cp"] == 1 else f"cp={r['cp']} {r['mode']}"
        print(f"{r['seq']:>7} {layout:14}{r['peak_growth'] / 2**30:9.3f}{ratio:8.3f}"
              f"{r['saved'] / 2**30:10.3f}{r['seconds']:8.1f}{speed:17.2f}")
        if r["cp"] > 1:
            verdicts.append((r, ratio <= TARGETS[r["cp"]], speed <= TIME_TARGET))
    for cp, target in TARGETS.items():
        mine = [v for v in verdicts if v[0]["cp"] == cp]
        if mine:
            print(f"cp={cp}: peak growth <= {target}x of cp=1's in {sum(v[1] for v in mine)}"
                  f"/{len(mine)} runs; time per token <= {TIME_TARGET}x in "
                  f"{sum(v[2] for v in mine)}/{len(mine)}")
    seqs = sorted(base)
    if len(seqs) >= 2:
        a, b = seqs[-2], seqs[-1]
        print(f"largest row fitting {BUDGET / 2**30:.0f} GiB of peak growth per rank "
              f"(extrapolated linearly from {a} and {b} tokens):")
        for layout in sorted({(r["cp"], r["mode"]) for r in rows}):
            at = {r["seq"]: r["peak_growth"] for r in rows if (r["cp"], r["mode"]) == layout}
            slope = (at[b] - at[a]) / (b - a)
            fits = b + (BUDGET - at[b]) / slope if slope > 0 else float("inf")
            print(f"  cp={layout[0]} {layout[1]:8} ~{fits / 1000:,.0f}k tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--save", default=str(RESULTS / "cp_memory.json"),
                        help="where the rows go (JSON; default %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if any(seq % 8 for seq in cli.seqs):
        parser.error("every length must divide into 2 x cp = 8 chunks")
    if cli.worker:
        worker(cli)
        return
    rows = []
    for cp in cli.cps:
        print(f"cp={cp}: {cp} rank(s)", flush=True)
        rows += launch(cp, cli.seqs)
    report(rows)
    Path(cli.save).write_text(json.dumps(rows, indent=1))
    print(f"rows written to {cli.save}")


if __name__ == "__main__":
    main()
