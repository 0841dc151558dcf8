"""The `merak` command line (also `python -m merak`)."""

from __future__ import annotations

import argparse
import sys

from merak.energy.cli import add_energy
from merak.pipeline.schedules import SCHEDULES, make_schedule
from merak.pipeline.simulator import CostModel, simulate
from merak.pipeline.timeline import TimelineEvent, save_chrome_trace, save_png
from merak.pipeline.validate import validate_schedule


def _costs(text: str) -> float | list[float]:
    """One number for every stage, or a comma-separated number per stage."""
    values = [float(v) for v in text.split(",")]
    return values[0] if len(values) == 1 else values


def _add_simulate(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="replay a schedule against a cost model",
        description="Validate a schedule, replay it against per-stage costs and print makespan, "
                    "bubble fraction per stage and peak in-flight activations.")
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--forward-cost", type=_costs, default=1.0,
                        help="forward time per micro-batch: one value, or one per stage "
                             "(comma-separated)")
    parser.add_argument("--backward-cost", type=_costs, default=2.0)
    parser.add_argument("--p2p-cost", type=float, default=0.0)
    parser.add_argument("--png", help="write the simulated timeline picture here")
    parser.add_argument("--trace", help="write the simulated timeline as Chrome trace JSON here")
    parser.set_defaults(run=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    for name in ("forward_cost", "backward_cost"):
        value = getattr(args, name)
        if isinstance(value, list) and len(value) != args.stages:
            raise SystemExit(f"--{name.replace('_', '-')} has {len(value)} values for "
                             f"{args.stages} stages")
    schedule = make_schedule(args.schedule, args.stages, args.microbatches)
    validate_schedule(schedule, args.microbatches)
    costs = CostModel(forward=args.forward_cost, backward=args.backward_cost, p2p=args.p2p_cost)
    result = simulate(schedule, costs)
    print(f"schedule {args.schedule}: {args.stages} stages x {args.microbatches} micro-batches")
    print(f"makespan            {result.makespan:.4f}")
    print(f"bubble (mean)       {result.bubble:.4f}")
    print("stage  busy       bubble   peak_activations")
    for s in range(args.stages):
        print(f"{s:5d}  {result.busy[s]:9.4f}  {result.bubble_per_stage[s]:.4f}   "
              f"{result.peak_activations[s]}")
    events = [TimelineEvent(e.stage_id, e.action.name, e.action.microbatch_id, e.start, e.end)
              for e in result.events]
    if args.png:
        path = save_png(events, args.png, title=f"{args.schedule} (simulated)",
                        row_label="stage", time_unit="s")
        print(f"timeline picture    {path}")
    if args.trace:
        print(f"chrome trace        {save_chrome_trace(events, args.trace, row_label='stage')}")
    return 0


def _add_export(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a Merak checkpoint as a plain HF save_pretrained directory")
    parser.add_argument("checkpoint", help="a checkpoint-<step> directory")
    parser.add_argument("out_dir", help="where to write config.json and model.safetensors")
    parser.set_defaults(run=_export)


def _export(args: argparse.Namespace) -> int:
    from merak.trainer.export import export_checkpoint

    print(f"exported {args.checkpoint} to {export_checkpoint(args.checkpoint, args.out_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="merak", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_simulate(subparsers)
    _add_export(subparsers)
    add_energy(subparsers)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
