"""`merak plan`: choose dp x tp x pp (x cp), micro-batching, schedule, recomputation and ZeRO.

Context parallelism is searched both ways (cp of 1, 2, 4, 8 where they divide the ranks and
the sequence; ``--no-context-parallel`` for a job with padded rows). Offline, for a described
cluster (no process group, nothing run):

    merak plan --model CONFIG_DIR --cluster h100 --world-size 64 --global-batch 512 \\
        --seq-len 8192 [--memory-gib 70] [--out plan.json]

Online, under torchrun on the job's own ranks: measures the links and the model's blocks,
predicts, dry-runs the best few candidates and keeps the fastest measured:

    torchrun --nproc_per_node 4 -m merak plan --model CONFIG_DIR --global-batch 16 \\
        --seq-len 128 [--memory-gib 2] [--dry-runs 3] [--out plan.json]

`merak.init(plan="plan.json")` and ``MerakArguments(plan="plan.json")`` reuse the choice.
"""

from __future__ import annotations

import argparse
import os

from merak.inputs import InputError, positive_float, positive_int, positive_ints
from merak.schedule.reference import REFERENCE_MODES


def add_plan(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="choose the parallel layout, schedule, recomputation and ZeRO stage",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="an HF config directory or config.json (or a model directory)")
    parser.add_argument("--world-size", "--gpus", type=positive_int, default=None,
                        dest="world_size",
                        help="ranks to plan for (default: the torchrun world size)")
    parser.add_argument("--global-batch", type=positive_int, required=True,
                        help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=positive_int, required=True)
    parser.add_argument("--memory-gib", type=positive_float, default=None,
                        help="per-rank memory limit (default: the cluster's or the device's)")
    parser.add_argument("--cluster", default=None,
                        help="offline: a preset (h100, h200, a100) or a cluster JSON file")
    parser.add_argument("--micro-batch-sizes", type=positive_ints, default=[1, 2, 4, 8],
                        help="comma-separated, e.g. 1,2,4,8")
    parser.add_argument("--parallel-vocab", action="store_true",
                        help="the job splits the embedding and LM head over TP ranks "
                             "(MerakArguments.parallel_vocab)")
    parser.add_argument("--no-sequence-parallel", action="store_true",
                        help="plan without sequence parallelism (a job with LoRA adapters, "
                             "text generation or TP overlap cannot split the sequence)")
    parser.add_argument("--no-context-parallel", action="store_true",
                        help="plan without context parallelism (cp = 1): for a job whose rows "
                             "are padded (cp splits whole, unpadded rows)")
    parser.add_argument("--no-expert-parallel", action="store_true",
                        help="plan an MoE model without expert parallelism (ep = 1)")
    parser.add_argument("--expert-imbalance", type=positive_float, default=1.0,
                        help="MoE: the busiest rank's routed (token, expert) pairs over the "
                             "mean, as a real batch routes them (1: even)")
    parser.add_argument("--reference", choices=REFERENCE_MODES, default="none",
                        help="a preference trainer's reference forwards (TRL's DPO, KTO): "
                             "'before' (one pass before training), 'per_step' (every "
                             "micro-batch, the policy's adapters off), 'replica' (every "
                             "micro-batch, a second model's frozen replica on each rank)")
    parser.add_argument("--epochs", type=positive_float, default=1.0,
                        help="epochs trained (the pass before training is charged per step "
                             "over them)")
    parser.add_argument("--dry-runs", type=positive_int, default=5,
                        help="online: candidates to run")
    parser.add_argument("--dry-run-steps", type=positive_int, default=3)
    parser.add_argument("--top", type=positive_int, default=12, help="rows of the printed table")
    parser.add_argument("--out", default="plan.json")
    parser.set_defaults(run=_plan)


def _config(path: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        raise InputError(f"--model {path}: no HF config there ({reason})") from None


def _cluster(spec: str, world_size: int | None):
    """A preset or a cluster JSON file (`merak.strategy.cluster`), or `InputError`."""
    from merak.strategy.cluster import cluster

    try:
        return cluster(spec, world_size)
    except (TypeError, ValueError) as error:
        raise InputError(f"--cluster {spec}: {error}") from None


def _plan(args: argparse.Namespace) -> int:
    from merak.strategy.candidate import BLOCK, RECOMPUTE_CHOICES
    from merak.strategy.cluster import GIB
    from merak.strategy.costs import analytic_costs
    from merak.strategy.reference import ReferenceCosts
    from merak.strategy.search import (
        context_parallel_degrees,
        search,
        sequence_parallel_choices,
    )
    from merak.strategy.shape import ModelShape

    config = _config(args.model)
    sequence_parallel = (False,) if args.no_sequence_parallel else \
        sequence_parallel_choices(config)
    sizes = args.micro_batch_sizes
    memory = args.memory_gib * GIB if args.memory_gib else None
    experts = (1,) if args.no_expert_parallel else None  # (None: every degree that divides)
    if args.cluster:
        world = args.world_size or int(os.environ.get("WORLD_SIZE", 0)) or None
        described = _cluster(args.cluster, world)
        shape = ModelShape.from_config(config)
        costs = {m: analytic_costs(shape, described, m, args.seq_len) for m in sizes}
        degrees = (1,) if args.no_context_parallel else \
            context_parallel_degrees(described.world_size, args.seq_len)
        plan = search(shape, costs, described, args.global_batch, args.seq_len, memory,
                      args.parallel_vocab, sequence_parallel=sequence_parallel,
                      context_parallel=degrees, recompute_choices=(*RECOMPUTE_CHOICES, BLOCK),
                      expert_parallel=experts, imbalance=args.expert_imbalance,
                      reference=ReferenceCosts(args.reference, args.epochs))
        moe = (f" ({shape.experts} experts a block, {shape.expert_params * shape.layers / 1e9:.2f}"
               f" B of them in the experts, {shape.experts_per_token} per token)"
               if shape.experts else "")
        print(f"{shape.name}: {shape.params / 1e9:.2f} B parameters{moe} on "
              f"{described.world_size} x {described.name}")
    else:
        from merak.dryrun.online import plan_online

        world = int(os.environ.get("WORLD_SIZE", 1))
        degrees = (1,) if args.no_context_parallel else \
            context_parallel_degrees(world, args.seq_len)
        plan = plan_online(config, args.global_batch, args.seq_len, memory, sizes,
                           dry_runs=args.dry_runs, steps=args.dry_run_steps,
                           parallel_vocab=args.parallel_vocab,
                           sequence_parallel=sequence_parallel, context_parallel=degrees,
                           expert_parallel=experts, imbalance=args.expert_imbalance,
                           reference=ReferenceCosts(args.reference, args.epochs))
        if plan is None:  # not rank 0
            return 0
    print(plan.table(args.top))
    print(f"chosen: {plan.chosen.label}\n{plan.why}")
    print(f"{len(plan.ranked)} candidates fit, {len(plan.dropped)} dropped; searched in "
          f"{plan.search_s:.2f} s")
    plan.write(args.out)
    print(f"wrote {args.out}")
    return 0
