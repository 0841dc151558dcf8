"""The main job: a small Hugging Face Llama trained with 3D parallelism (dp x tp x pp) on CPU.

    torchrun --nproc_per_node 8 examples/train_llama_3d.py --dp 2 --tp 2 --pp 2

The model is built from a config on the meta device (no memory), then `merak.parallelize`
applies tensor parallelism (vocab-parallel embedding and LM head included), splits it into
pipeline stages automatically, and materializes only this rank's shard of its stage. It trains
on the Python standard library's own source (byte-level tokens, nothing downloaded), prints loss
and tokens/s per step, and writes the last step's timeline (PNG + Chrome trace).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import merak
from merak.data.text import TokenBatches, stdlib_source_bytes
from merak.pipeline.cpu_threads import threads_per_rank
from merak.pipeline.timeline import gather_events, save_chrome_trace, save_png


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(merak.SCHEDULES))
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
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
    ctx = merak.init(dp=args.dp, tp=args.tp, pp=args.pp)
    log = print if ctx.rank == 0 else (lambda *a, **k: None)

    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len)
    torch.manual_seed(args.seed)
    with merak.init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    example = torch.zeros(args.micro_batch_size, args.seq_len, dtype=torch.long)
    stage = merak.parallelize(model, {"input_ids": example, "labels": example}, ctx,
                              parallel_vocab=True, sequence_parallel=args.sequence_parallel)
    log(f"{ctx.describe()}\n{stage.split.describe()}")

    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=0.0)
    recorder = merak.TimelineRecorder(row=ctx.rank)
    engine = merak.PipelineInterpreter(stage, ctx, optimizer, args.microbatches,
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
        batch = None
        if engine.batch_keys:  # HF shifts the labels itself
            ids = data.shard(step, ctx.dp_rank, ctx.dp)["input_ids"]
            batch = {"input_ids": ids, "labels": ids.clone()}
        loss = engine.train_step(batch)
        dt = time.perf_counter() - t0
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        log(f"step {step + 1:4d}/{args.steps}  loss {loss:.4f}  {tokens_per_step / dt:8.0f} tokens/s")
    elapsed = time.perf_counter() - start
    events = gather_events(recorder.events)
    if ctx.rank == 0:
        out = Path(args.out)
        png = save_png(events, out / "timeline.png", title=f"{args.schedule}: dp={args.dp} "
                       f"tp={args.tp} pp={args.pp}, last step")
        trace = save_chrome_trace(events, out / "timeline.json")
        print(f"done: loss {first_loss:.4f} -> {last_loss:.4f}, "
              f"{tokens_per_step * args.steps / elapsed:.0f} tokens/s overall")
        print(f"timeline picture: {png}\nchrome trace (open in Perfetto): {trace}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
