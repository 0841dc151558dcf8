"""Tokens/s of every pipeline schedule in one 4-rank CPU run, against the simulator's ordering;
and (`--simulate`) the simulator's bubble and peak activations of 1F1B, ZB-V and DualPipeV.

    .venv/bin/python bench/schedules.py             # 4 ranks (pp=4), a few minutes on 2 cores
    .venv/bin/python bench/schedules.py --simulate  # the simulator only: p = 4, m = 16

Launches itself under torchrun (`--ranks` ranks, pp = that number, CPU/gloo). A Llama-style
model (`--layers` blocks, hidden `--hidden`) is auto-split into pp stages and trained with SGD on
`--microbatches` micro-batches of `--micro-batch-size` x `--seq-len` tokens. One interpreter
switches between schedules (`set_recomputation(ratio, schedule=...)`): the recomputation schedules
recompute every block of every stage (1f1b with recomputation is their baseline); 1f1b and
zero_bubble run without, interleaved_1f1b runs a second copy of the model split into 2 model
chunks per rank, zbv and dualpipev a third, in 2 chunks per rank placed in a V (one
interpreter runs both). After one warm-up step each, 3 timed runs: in
each, every schedule runs `--steps` steps, in an order that rotates from run to run. Rank 0 prints,
per schedule, the median tokens/s over the 3 runs, its ratio to 1f1b with recomputation measured in
this same launch, and the simulator's makespan for the issue's costs (forward 1, backward 2,
recomputation 1) for comparison of the orderings.

Ranks share the machine's cores (4 ranks on 2 cores: stages that the simulator runs in parallel
here compete for cores, and idle-core lending gives a lone stage the idle ones), so expect
smaller differences than the simulator's: read the ordering and the ratios.

`--simulate` replays 1f1b, zbv and dualpipev on `--ranks` ranks and `--microbatches`
micro-batches (default 16) with forward = input gradient = weight gradient = 1 per rank (a V's
chunk takes half of each) and prints, side by side, each one's makespan, idle per rank, mean
bubble and its ratio to 1F1B's, and per rank the peak in-flight micro-batch chunks and peak
activations in 1F1B stages (a V's chunk holds half a stage).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from _common import engine_options

RUNS = 3
# name, schedule, recompute every block
VARIANTS = [("1f1b+recompute", "1f1b", True), ("pre_recompute_1f1b", "pre_recompute_1f1b", True),
            ("last_no_recompute_1f1b", "last_no_recompute_1f1b", True),
            ("shifted_critical_path", "shifted_critical_path", True),
            ("1f1b", "1f1b", False), ("zero_bubble", "zero_bubble", False),
            ("interleaved_1f1b (v=2)", "interleaved_1f1b", False), ("zbv", "zbv", False),
            ("dualpipev", "dualpipev", False)]
SIMULATED = ("1f1b", "zbv", "dualpipev")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=None,
                        help="default 8 (measured), 16 (--simulate)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--simulate", action="store_true",
                        help="print the simulator's bubble and memory of 1f1b, zbv, dualpipev")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers as tf

    import merak
    from merak.engine.assemble import build_engine
    from merak.schedule.registry import SCHEDULES
    from merak.schedule.simulator import CostModel, simulate

    ctx = merak.init(dp=1, tp=1, pp=args.ranks)
    config = tf.LlamaConfig(vocab_size=1024, hidden_size=args.hidden,
                            intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=8, num_key_value_heads=8,
                            max_position_embeddings=args.seq_len)
    rows = args.micro_batch_size * args.microbatches
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (rows, args.seq_len), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    example = {k: v[:args.micro_batch_size] for k, v in batch.items()}
    sgd = lambda stage: torch.optim.SGD(stage.parameters(), lr=1e-4)
    engines = []
    for schedule in ("1f1b", "interleaved_1f1b", "zbv"):  # 1 stage, 2 chunks, 2 in a V per rank
        torch.manual_seed(0)
        with merak.init_empty_weights():
            model = tf.LlamaForCausalLM(config)
        options = engine_options(schedule=schedule, num_microbatches=args.microbatches,
                                 num_model_chunks=2)
        engines.append(build_engine(model, example, ctx, options,
                                    make_optimizer=sgd).interpreter)
    engine, interleaved, vshaped = engines
    tokens = rows * args.seq_len
    rates: dict[str, list[float]] = {name: [] for name, _, _ in VARIANTS}

    def runner_of(schedule: str, recompute: bool):
        info = SCHEDULES[schedule]
        if info.fixed_stages_per_rank is not None:
            vshaped.set_recomputation(0.0, schedule=schedule)
            return vshaped
        if info.several_stages_per_rank:
            return interleaved
        engine.set_recomputation(1.0 if recompute else 0.0, schedule=schedule)
        return engine

    def run(schedule: str, recompute: bool, steps: int) -> float:
        runner = runner_of(schedule, recompute)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            runner.train_step(batch)
        dist.barrier()
        return steps * tokens / (time.perf_counter() - start)

    for _, schedule, recompute in VARIANTS:  # warm-up
        run(schedule, recompute, steps=1)
    for r in range(RUNS):
        for i in range(len(VARIANTS)):
            name, schedule, recompute = VARIANTS[(i + r) % len(VARIANTS)]
            rates[name].append(run(schedule, recompute, args.steps))
    engine.remove_recomputation()
    if ctx.rank == 0:
        costs = CostModel(forward=1, backward=2, recompute=1)
        base = statistics.median(rates["1f1b+recompute"])
        print(f"{ctx.pp} stages x {args.microbatches} micro-batches, {args.layers} Llama blocks "
              f"(hidden {args.hidden}), {tokens} tokens per step, median of {RUNS} runs x "
              f"{args.steps} steps")
        print(f"{'schedule':24s} {'tokens/s':>9s} {'min':>8s} {'max':>8s} {'vs 1f1b+rc':>10s}"
              f" {'simulated makespan (f1 b2 r1)':>30s}")
        for name, schedule, recompute in VARIANTS:
            span = simulate(runner_of(schedule, recompute).schedule, costs).makespan
            median = statistics.median(rates[name])
            print(f"{name:24s} {median:9.1f} {min(rates[name]):8.1f} {max(rates[name]):8.1f} "
                  f"{median / base:10.3f} {span:30.0f}")
    dist.destroy_process_group()


def simulated(ranks: int, microbatches: int) -> None:
    """The simulator's bubble and peak activations of `SIMULATED`, side by side."""
    from merak.schedule.registry import SCHEDULES, make_schedule
    from merak.schedule.simulator import CostModel, MemoryModel, simulate
    from merak.schedule.validate import validate_schedule

    costs = CostModel(forward=1.0, backward=2.0, weight_grad=1.0)
    results = {}
    for name in SIMULATED:
        schedule = make_schedule(name, ranks, microbatches,
                                 stages_per_rank=SCHEDULES[name].stages_per_rank(2))
        validate_schedule(schedule)
        results[name] = simulate(schedule, costs, MemoryModel(full=1.0))
    base = results["1f1b"].bubble
    print(f"simulated, {ranks} ranks x {microbatches} micro-batches, forward = input gradient = "
          f"weight gradient = 1 per rank")
    print(f"{'schedule':10s} {'makespan':>8s} {'idle/rank':>9s} {'bubble':>7s} {'vs 1f1b':>7s}"
          f"  in flight (chunks)  activations (1F1B stages)")
    for name, r in results.items():
        idle = max(r.idle_per_stage)
        print(f"{name:10s} {r.makespan:8.1f} {idle:9.2f} {r.bubble:7.4f} {r.bubble / base:7.3f}"
              f"  {str(r.peak_activations):18s}  {[round(m, 2) for m in r.peak_memory]}")


def main() -> None:
    args = parse_args()
    if args.simulate:
        simulated(args.ranks, args.microbatches or 16)
        return
    args.microbatches = args.microbatches or 8
    if args.worker:
        rank_main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
           __file__, "--worker", *sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
