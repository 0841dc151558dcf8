"""Sub-pipelined tensor parallelism (`set_tp_overlap`): tokens/s of levels 0, 1 and 2 at tp=2.

    .venv/bin/python bench/tp_overlap.py                 # GPT-2, a minute or two on 2 cores
    .venv/bin/python bench/tp_overlap.py --model llama --sub-batches 4

Launches itself under torchrun on `--nproc` ranks (tp = that number, CPU/gloo, one compute
thread per rank). A GPT-2- or Llama-style model (hidden 512, 4 blocks, 8 heads, vocab 2048),
forward + backward of one micro-batch of 8 x 128 tokens (no optimizer step). After one warm-up
step per level (which also checks that the levels' losses agree), 3 timed runs: in each, every
level runs `--steps` steps, the levels taking turns step by step (in an order that rotates so
that none always goes first), so that a change of load on the machine hits them alike. The table
gives, per level, the median over the 3 runs of its tokens/s (and the slowest and fastest run),
and the ratio of its median to level 0's median, all measured in this same launch.

On CPU the all-reduces run on gloo's threads, which share the cores with compute (2 ranks on a
2-core machine leave no core free), so expect small gains or losses here: read the ratio, not
the absolute numbers, and rerun on GPUs (NCCL) for figures that matter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HIDDEN, LAYERS, HEADS, VOCAB, BATCH, SEQ = 512, 4, 8, 2048, 8, 128
RUNS = 3


def build(model: str):
    import transformers as tf

    if model == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
        max_position_embeddings=SEQ))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import merak
    from merak.tensor_parallel.overlap.levels import LEVELS, set_tp_overlap

    torch.set_num_threads(1)
    ctx = merak.init(dp=1, tp=int(os.environ["WORLD_SIZE"]), pp=1)
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = build(args.model)
    merak.apply_tensor_parallel(model, ctx)
    merak.materialize_(model)
    model.train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        return loss.item()

    losses = {}
    for level in LEVELS:  # warm-up, and the levels compute the same loss
        set_tp_overlap(model, level, args.sub_batches)
        losses[level] = step()
    for level in LEVELS:
        torch.testing.assert_close(losses[level], losses[0], rtol=1e-5, atol=1e-6)

    def timed_step(level: int) -> float:
        set_tp_overlap(model, level, args.sub_batches)
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64,
                               device=ctx.device)  # NCCL reduces device tensors only
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        return elapsed.item()

    load_before = os.getloadavg()[0]
    tokens_per_s: dict[int, list[float]] = {level: [] for level in LEVELS}
    levels = list(LEVELS)
    for _ in range(RUNS):
        seconds = dict.fromkeys(LEVELS, 0.0)
        for i in range(args.steps):  # one step of each level in turn: they share any drift
            for level in levels[i % len(levels):] + levels[:i % len(levels)]:
                seconds[level] += timed_step(level)
        for level in LEVELS:
            tokens_per_s[level].append(args.steps * BATCH * SEQ / seconds[level])
    set_tp_overlap(model, 0)

    if ctx.rank == 0:
        base = statistics.median(tokens_per_s[0])
        print(f"{args.model}, tp={ctx.tp} (gloo, CPU), hidden {HIDDEN}, {LAYERS} blocks, "
              f"{HEADS} heads, batch {BATCH}x{SEQ}, num_sub_batches={args.sub_batches}, "
              f"1 thread/rank, fwd+bwd; median of {RUNS} runs of {args.steps} steps per level, "
              f"levels alternated step by step")
        print(f"  {'level':<42} {'tokens/s':>9} {'(min-max of runs)':>18} {'vs level 0':>11}")
        for level, meaning in LEVELS.items():
            runs = tokens_per_s[level]
            median = statistics.median(runs)
            print(f"  {f'{level} ({meaning})':<42} {median:9.0f} "
                  f"{f'({min(runs):.0f}-{max(runs):.0f})':>18} {median / base:11.3f}")
        print(f"  machine load (1-min average) {load_before:.1f} before, {os.getloadavg()[0]:.1f} "
              f"after, on {os.cpu_count()} cores: above {ctx.tp} other jobs share the cores")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--sub-batches", type=int, default=2,
                        help="sub-batches per micro-batch (set_tp_overlap's num_sub_batches)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per level per run")
    parser.add_argument("--nproc", type=int, default=2, help="ranks, = tp")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.nproc), __file__, "--rank-main", "--model", args.model,
           "--sub-batches", str(args.sub_batches), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        raise SystemExit(f"the benchmark ranks failed:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    print(proc.stdout.strip())


if __name__ == "__main__":
    main()
