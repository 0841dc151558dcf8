"""The main job: a small GPT trained with pipeline x data parallelism on CPU.

    torchrun --nproc_per_node 4 examples/train_gpt_pipeline.py --pp 2 --dp 2

Trains on the Python standard library's own source (byte-level tokens, nothing downloaded),
prints loss and tokens/s per step, and writes the last step's timeline (PNG + Chrome trace).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import merak
from merak.data.text import TokenBatches, stdlib_source_bytes
from merak.models.gpt import GPT, GPTConfig, gpt_pieces
from merak.runtime.cpu_threads import threads_per_rank
from merak.runtime.hooks import gather_events
from merak.schedule.timeline import save_chrome_trace, save_png


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(merak.SCHEDULES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/main_job")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(threads_per_rank())
    ctx = merak.init(dp=args.dp, tp=1, pp=args.pp)
    log = print if ctx.rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(args.seed)  # every rank builds the same model, then keeps its stage
    config = GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                       max_positions=args.seq_len)
    model = GPT(config)
    split = merak.manual_split(model, gpt_pieces(model), num_stages=args.pp)
    stage = merak.PipelineStage(model, split, ctx.pp_rank)
    del model
    log(f"{ctx.describe()}\n{split.describe()}")

    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=0.0)
    recorder = merak.TimelineRecorder(row=ctx.rank, device=ctx.device)
    engine = merak.PipelineInterpreter(stage, ctx, optimizer, num_microbatches=args.microbatches,
                                       schedule=args.schedule, hooks=[recorder])
    global_batch = args.micro_batch_size * args.microbatches * args.dp
    data = TokenBatches(stdlib_source_bytes(), args.seq_len, global_batch, seed=args.seed)
    tokens_per_step = global_batch * args.seq_len
    log(f"training {args.steps} steps, global batch {global_batch} x {args.seq_len} tokens, "
        f"schedule {args.schedule}")

    first_loss = last_loss = None
    start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = data.shard(step, ctx.dp_rank, ctx.dp) if engine.batch_keys else None
        loss = engine.train_step(batch)
        dt = time.perf_counter() - t0
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        log(f"step {step + 1:4d}/{args.steps}  loss {loss:.4f}  "
            f"{tokens_per_step / dt:8.0f} tokens/s")
    elapsed = time.perf_counter() - start
    events = gather_events(recorder.events)
    if ctx.rank == 0:
        out = Path(args.out)
        png = save_png(events, out / "timeline.png",
                       title=f"{args.schedule}: pp={args.pp} dp={args.dp}, last step")
        trace = save_chrome_trace(events, out / "timeline.json")
        print(f"done: loss {first_loss:.4f} -> {last_loss:.4f}, "
              f"{tokens_per_step * args.steps / elapsed:.0f} tokens/s overall")
        print(f"timeline picture: {png}\nchrome trace (open in Perfetto): {trace}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
