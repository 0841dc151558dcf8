"""`merak simulate`: replay a schedule (or compare every schedule) against a cost model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from merak.inputs import (
    InputError,
    check_work,
    non_negative_float,
    non_negative_floats,
    positive_int,
)
from merak.schedule.registry import SCHEDULES, make_schedule
from merak.schedule.simulator import CostModel, MemoryModel, SimulationResult, simulate
from merak.schedule.timeline import TimelineEvent, save_chrome_trace, save_png
from merak.schedule.validate import validate_schedule

PER_STAGE = ("forward_cost", "backward_cost", "recompute_cost", "weight_grad_cost",
             "activation_memory", "kept_memory")
# compute blocks (stages x micro-batches x chunks) one simulation handles: 8,192 take about
# 2 s and 40 MiB; time and memory grow with them (a million would take GBs and minutes)
MAX_BLOCKS = 16_384


def add_simulate(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="replay a schedule against a cost model",
        description="Validate a schedule, replay it against per-stage costs and print makespan, "
                    "bubble per stage, peak in-flight micro-batches and peak activation memory. "
                    "Costs and memories take one value or one per stage (comma-separated).")
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--stages", type=positive_int, required=True)
    parser.add_argument("--interleave", type=positive_int, default=None, metavar="V",
                        help="model chunks per rank for interleaved_1f1b (default 2; costs and "
                             "memories stay per rank, each chunk takes 1/V); --compare includes "
                             "interleaved_1f1b when V > 1 (zbv and dualpipev: always 2, in a V)")
    parser.add_argument("--microbatches", type=positive_int, required=True)
    parser.add_argument("--forward-cost", type=non_negative_floats, default=1.0)
    parser.add_argument("--backward-cost", type=non_negative_floats, default=2.0,
                        help="input- plus weight-gradient time")
    parser.add_argument("--recompute-cost", type=non_negative_floats, default=None,
                        help="turns recomputation on (every stage) with this rerun time")
    parser.add_argument("--weight-grad-cost", type=non_negative_floats, default=None,
                        help="the weight-gradient part of the backward, for zero_bubble "
                             "(default: half the backward)")
    parser.add_argument("--p2p-cost", type=non_negative_float, default=0.0)
    parser.add_argument("--activation-memory", type=non_negative_floats, default=1.0,
                        help="activation memory one micro-batch keeps for backward")
    parser.add_argument("--kept-memory", type=non_negative_floats, default=None,
                        help="what it keeps when recomputed (default: a quarter of "
                             "--activation-memory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--programs", action="store_true",
                        help="print every rank's program as JSON (what each rank posts: stage, "
                             "action, micro-batch, peer rank, posting group) and exit")
    parser.add_argument("--compare", metavar="DIR",
                        help="simulate every schedule: print a table and write DIR/<name>.png")
    parser.add_argument("--png", help="write the simulated timeline picture here")
    parser.add_argument("--trace", help="write the simulated timeline as Chrome trace JSON here")
    parser.set_defaults(run=run_simulate)


def _models(args: argparse.Namespace) -> tuple[CostModel, MemoryModel]:
    for name in PER_STAGE:
        value = getattr(args, name)
        if isinstance(value, list) and len(value) != args.stages:
            raise InputError(f"--{name.replace('_', '-')} has {len(value)} values for "
                             f"{args.stages} stages; give one value, or one per stage")
    kept = args.kept_memory
    if kept is None:
        full = args.activation_memory
        kept = [f / 4 for f in full] if isinstance(full, list) else full / 4
    costs = CostModel(forward=args.forward_cost, backward=args.backward_cost,
                      recompute=args.recompute_cost, weight_grad=args.weight_grad_cost,
                      p2p=args.p2p_cost)
    return costs, MemoryModel(full=args.activation_memory, kept=kept)


def _stages_per_rank(name: str, args: argparse.Namespace) -> int:
    return SCHEDULES[name].stages_per_rank(args.interleave or 2)


def _schedule(name: str, args: argparse.Namespace):
    chunks = _stages_per_rank(name, args)
    check_work("--stages x --microbatches x model chunks", args.stages * args.microbatches
               * chunks, MAX_BLOCKS, "simulate fewer stages or micro-batches")
    try:
        return make_schedule(name, args.stages, args.microbatches, stages_per_rank=chunks,
                             recompute=args.recompute_cost is not None)
    except ValueError as error:
        raise InputError(str(error)) from None


def _run_one(name: str, args: argparse.Namespace, costs: CostModel,
             memory: MemoryModel) -> SimulationResult:
    schedule = _schedule(name, args)
    validate_schedule(schedule)
    return simulate(schedule, costs, memory=memory)


def _summary(result: SimulationResult) -> dict:
    return {"makespan": result.makespan, "bubble": result.bubble,
            "idle": result.idle_per_stage, "peak_activations": result.peak_activations,
            "peak_memory": result.peak_memory}


def _events(result: SimulationResult) -> list[TimelineEvent]:
    return [TimelineEvent(e.rank, e.action.name, e.action.microbatch_id, e.start, e.end)
            for e in result.events]


def run_simulate(args: argparse.Namespace) -> int:
    fixed = SCHEDULES[args.schedule].fixed_stages_per_rank
    if fixed is not None and args.interleave not in (None, fixed):
        raise SystemExit(f"--schedule {args.schedule} places {fixed} stages on every rank; "
                         f"--interleave {args.interleave} does not apply")
    if args.programs:
        schedule = _schedule(args.schedule, args)
        validate_schedule(schedule)
        print(json.dumps(schedule.to_json()))
        return 0
    if args.compare:
        return _compare(args)
    result = _run_one(args.schedule, args, *_models(args))
    if args.json:
        print(json.dumps(_summary(result)))
    else:
        v = _stages_per_rank(args.schedule, args)
        shape = " in a V" if SCHEDULES[args.schedule].fixed_stages_per_rank else ""
        chunks = f", {v} model chunks each{shape}" if v > 1 else ""
        print(f"schedule {args.schedule}: {args.stages} stages x {args.microbatches} "
              f"micro-batches{chunks}")
        print(f"makespan            {result.makespan:.4f}")
        print(f"bubble (mean)       {result.bubble:.4f}")
        print("stage  busy       idle       bubble   peak_activations  peak_memory")
        for s in range(args.stages):
            print(f"{s:5d}  {result.busy[s]:9.4f}  {result.idle_per_stage[s]:9.4f}  "
                  f"{result.bubble_per_stage[s]:.4f}   {result.peak_activations[s]:16d}  "
                  f"{result.peak_memory[s]:.4f}")
    if args.png:
        path = save_png(_events(result), args.png, title=f"{args.schedule} (simulated)",
                        row_label="stage", time_unit="s")
        print(f"timeline picture    {path}")
    if args.trace:
        print(f"chrome trace        "
              f"{save_chrome_trace(_events(result), args.trace, row_label='stage')}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    out = Path(args.compare)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n, info in SCHEDULES.items()
             if (args.recompute_cost is not None or not info.needs_recompute)
             and ((args.interleave or 1) > 1 or not info.several_stages_per_rank
                  or info.fixed_stages_per_rank is not None)]
    models = _models(args)
    results = {name: _run_one(name, args, *models) for name in names}
    if args.json:
        print(json.dumps({name: _summary(r) for name, r in results.items()}))
    else:
        recompute = "with" if args.recompute_cost is not None else "without"
        print(f"{args.stages} stages x {args.microbatches} micro-batches, {recompute} "
              f"recomputation")
        print(f"{'schedule':24s} {'makespan':>9s} {'idle/stage':>10s} {'bubble':>7s}  "
              f"peak in-flight   peak memory")
        for name, r in results.items():
            idle = sum(r.idle_per_stage) / len(r.idle_per_stage)
            print(f"{name:24s} {r.makespan:9.3f} {idle:10.3f} {r.bubble:7.4f}  "
                  f"{r.peak_activations!s:15s}  {[round(m, 3) for m in r.peak_memory]}")
    for name, r in results.items():
        save_png(_events(r), out / f"{name}.png", title=f"{name} (simulated)",
                 row_label="stage", time_unit="s")
    if not args.json:
        print(f"timeline pictures   {out}/<schedule>.png")
    return 0
