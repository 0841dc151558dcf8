"""`merak energy ...`: plan GPU clocks from a profile, serve plans to training jobs over the
Perseus protocol, and report a run's energy against the all-max-clock baseline. (Profiling is a
MerakTrainer mode: `MerakArguments(energy_gpu=..., energy_profile="profile.csv")`.)"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from merak.inputs import (
    InputError,
    check_work,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from merak.schedule.actions import ActionKind, Schedule
from merak.schedule.reference import PER_STEP_MODES, REFERENCE_MODES
from merak.schedule.registry import SCHEDULES, make_schedule, placement_of, reference_pass
from merak.schedule.simulate_cli import MAX_BLOCKS
from merak.schedule.validate import validate_schedule


def port_number(text: str) -> int:
    port = non_negative_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0 .. 65535, got {text!r}")
    return port


def add_energy(subparsers) -> None:
    parser = subparsers.add_parser("energy", help="Perseus energy planning of pipeline training")
    commands = parser.add_subparsers(dest="energy_command", required=True)
    plan = commands.add_parser(
        "plan", help="the iteration-time / energy frontier and a clock plan per rank",
        description="Build the pipeline DAG from merak's schedule, compute the time / energy "
                    "frontier with lowtime and write the chosen per-rank clock plan as JSON, "
                    "with a PNG of the frontier.")
    plan.add_argument("profile", help="the CSV `merak energy profile` wrote")
    plan.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES),
                      help="; ".join(f"{name}: {info.summary}" for name, info in
                                     sorted(SCHEDULES.items())))
    plan.add_argument("--stages", type=positive_int, default=None,
                      help="pipeline ranks (pp; required without --programs)")
    plan.add_argument("--microbatches", type=positive_int, default=None,
                      help="micro-batches per step (required without --programs)")
    plan.add_argument("--interleave", type=positive_int, default=None, metavar="V",
                      help="model chunks per pipeline rank (interleaved_1f1b: "
                           "MerakArguments.num_model_chunks; zbv and dualpipev: 2, the "
                           "default; the others: 1)")
    plan.add_argument("--recompute", nargs="?", const="all", default=None, metavar="FLAGS",
                      help="the job checkpoints activations (activation_checkpointing; needed by "
                           "the schedules that reorder recomputation): every stage, or one 0/1 "
                           "flag per stage, comma-separated (stages x interleave values)")
    plan.add_argument("--reference", choices=REFERENCE_MODES, default="none",
                      help="a preference trainer's reference forwards (TRL's DPO, KTO), "
                           "reference_forward instructions with clocks of their own: "
                           "'per_step' / 'replica' run one before each forward of the step; "
                           "'before' plans the forward-only pass before training over one "
                           "step's micro-batches instead of the step")
    plan.add_argument("--programs", metavar="FILE", default=None,
                      help="the schedule itself, as JSON (what `merak simulate --programs` "
                           "prints; energy_mode='auto' hands its planner the interpreter's "
                           "programs so): instead of --schedule, --stages, --microbatches, "
                           "--interleave and --recompute")
    plan.add_argument("--p2p-power", type=non_negative_float, default=None,
                      help="watts a GPU draws blocked on p2p (default: the profile's p2p rows)")
    choice = plan.add_mutually_exclusive_group()
    choice.add_argument("--target-time", type=positive_float, default=None,
                        help="iteration time to meet, seconds (e.g. set by a straggler)")
    choice.add_argument("--max-slowdown", type=non_negative_float, default=None,
                        help="minimum energy within this fractional slowdown, e.g. 0.05")
    plan.add_argument("--unit-time", type=positive_float, default=None,
                      help="the solver's time quantum, seconds (default 1 ms or finer)")
    plan.add_argument("--coarse", type=positive_int, default=4,
                      help="coarse to fine: walk the frontier at this many time units per step, "
                           "then at one unit around the chosen point (1: the whole frontier at "
                           "one unit, slowest)")
    plan.add_argument("--window", type=non_negative_int, default=6,
                      help="clocks either side of the coarse plan's the fine walk may use")
    plan.add_argument("--out", default="plan.json")
    plan.set_defaults(run=_plan)

    serve = commands.add_parser(
        "serve", help="serve plans to training jobs (Perseus / Zeus PFO protocol)",
        description="A Perseus server: training jobs (MerakArguments.pfo_server_url, or Zeus's "
                    "client) register and fetch each rank's clock schedule from the plan that "
                    "fits their world size and pipeline degree, and report their steps back.")
    serve.add_argument("--plan", action="append", required=True,
                       help="a `merak energy plan` JSON (repeat for several job shapes)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=7787)
    serve.add_argument("--results-dir", default=None,
                       help="append every reported step window here, one JSON line per report "
                            "(16 MiB per job file, then rotated; 1 GiB in all)")
    serve.add_argument("--max-body-bytes", type=positive_int, default=256 * 2**10,
                       help="larger requests are refused with 413 (default 256 KiB)")
    serve.add_argument("--readers", type=positive_int, default=128,
                       help="request bodies received at once; the others wait (default 128)")
    serve.add_argument("--concurrency", type=positive_int, default=8,
                       help="requests parsed and handled at once; the others wait (default 8)")
    serve.add_argument("--body-timeout", type=positive_float, default=30.0,
                       help="seconds a request's body may take to arrive (then 408)")
    serve.add_argument("--max-jobs", type=positive_int, default=1024,
                       help="jobs kept; past it the one idle longest is forgotten")
    serve.set_defaults(run=_serve)

    report = commands.add_parser(
        "report", help="a run's time and energy per step against all max clocks",
        description="Compare the energy_steps.csv that MerakTrainer writes (with energy_gpu "
                    "set) against an all-max-clock run, or the baseline a plan predicted.")
    report.add_argument("run_steps", metavar="run", help="the run's energy_steps.csv")
    report.add_argument("--baseline", help="an all-max-clock run's energy_steps.csv")
    report.add_argument("--plan", help="the plan the run used (adds its prediction)")
    report.add_argument("--skip", type=non_negative_int, default=1,
                        help="warm-up steps to leave out")
    report.set_defaults(run=_report)


def main(argv: list[str]) -> int:
    """``python -m merak.energy COMMAND ...`` (`merak energy COMMAND ...`) in a process that
    imports only `merak.energy` and what the command needs (the background planner of
    ``energy_mode="auto"``); exit status 2 with a one-line reason for bad input."""
    parser = argparse.ArgumentParser(prog="python -m merak.energy")
    add_energy(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["energy", *argv])
    try:
        return args.run(args)
    except InputError as error:
        print(f"merak energy {args.energy_command}: error: {error}", file=sys.stderr)
        return 2


def _schedule(args: argparse.Namespace):
    """The schedule to plan: `--programs`' JSON, or the one the options name; fills in
    `args.schedule`, `args.stages`, `args.microbatches`, `args.interleave` from it, and returns
    (schedule, the recompute flags recorded in the plan)."""
    if args.programs is not None:
        try:
            schedule = Schedule.from_json(json.loads(Path(args.programs).read_text()))
            validate_schedule(schedule)
        except (OSError, KeyError, TypeError, ValueError) as error:
            raise InputError(f"cannot read the schedule {args.programs}: {error!r}") from None
        args.schedule, args.stages = schedule.name, schedule.num_ranks
        args.microbatches, args.interleave = schedule.num_microbatches, schedule.stages_per_rank
        flags = [any(a.kind is ActionKind.RECOMPUTE for a in schedule.stage_actions(s))
                 for s in range(schedule.num_stages)]
        check_work("the schedule's stages x micro-batches", len(flags) * args.microbatches,
                   MAX_BLOCKS, "plan fewer stages or micro-batches")
        return schedule, True if all(flags) else flags if any(flags) else False
    if args.stages is None or args.microbatches is None:
        raise InputError("give --stages and --microbatches, or the schedule as --programs FILE")
    if args.interleave is None:  # the schedule's own chunks per rank (2 for the V schedules)
        args.interleave = SCHEDULES[args.schedule].stages_per_rank(1)
    check_work("--stages x --microbatches x --interleave", args.stages * args.microbatches
               * args.interleave, MAX_BLOCKS, "plan fewer stages or micro-batches")
    try:
        recompute = recompute_flags(args.recompute)
        if args.reference == "before":  # the pass before training, placed as the step's
            placement = placement_of(args.schedule, args.stages, args.interleave)
            return reference_pass(args.stages, args.microbatches,
                                  stages_per_rank=args.interleave, placement=placement), False
        return make_schedule(args.schedule, args.stages, args.microbatches,
                             stages_per_rank=args.interleave, recompute=recompute,
                             reference=args.reference in PER_STEP_MODES), recompute
    except ValueError as error:
        raise InputError(str(error)) from None


def _plan(args: argparse.Namespace) -> int:
    from merak.energy.planning.frontier import ClockFrontier
    from merak.energy.planning.plan_file import save_clock_plan
    from merak.energy.profiling.profile_data import aggregate, read_profile
    from merak.energy.reporting.figures import save_frontier_png

    schedule, recompute = _schedule(args)
    try:
        profiles, measured_p2p = aggregate(read_profile(args.profile))
    except (OSError, KeyError, ValueError) as error:
        raise InputError(f"cannot read the profile {args.profile}: {error}") from None
    if len(profiles) != args.stages:
        raise InputError(f"{args.profile} profiles {len(profiles)} pipeline ranks, not --stages "
                         f"{args.stages}")
    p2p_power = args.p2p_power if args.p2p_power is not None else measured_p2p
    if p2p_power is None:
        raise InputError("the profile has no p2p rows: give --p2p-power W")
    try:
        planner = ClockFrontier(schedule, profiles, p2p_power, unit_time=args.unit_time)
    except ValueError as error:
        raise InputError(str(error)) from None
    start = time.perf_counter()
    base_time, base_energy = planner.evaluate(planner.max_clock_plan())
    limit = planner.time_limit(base_time, args.target_time, args.max_slowdown)
    points = planner.frontier(focus_time=limit, coarse=args.coarse, window=args.window)
    chosen = planner.choose(points, base_time, args.target_time, args.max_slowdown)
    took = time.perf_counter() - start
    out = save_clock_plan(args.out, planner.schedules(chosen.plan),
                          {"time_s": chosen.time_s, "energy_j": chosen.energy_j},
                          {"time_s": base_time, "energy_j": base_energy},
                          {"schedule": args.schedule, "stages": args.stages,
                           "microbatches": args.microbatches, "interleave": args.interleave,
                           "recompute": recompute, "p2p_power_w": p2p_power})
    png = save_frontier_png(points, chosen, (base_time, base_energy), out.with_suffix(".png"),
                            limit_s=limit)
    print(f"all max clocks   {base_time:.4f} s  {base_energy:.1f} J")
    print(f"chosen plan      {chosen.time_s:.4f} s  {chosen.energy_j:.1f} J  "
          f"({chosen.time_s / base_time - 1:+.2%} time, {1 - chosen.energy_j / base_energy:.2%} "
          f"energy saved)")
    print(f"frontier         {len(points)} points in {took:.1f} s; plan {out}, picture {png}")
    return 0


def recompute_flags(value: str | None) -> bool | list[bool]:
    """``--recompute``: absent (False), bare (True: every stage) or per-stage 0/1 flags."""
    if value is None or value == "all":
        return value is not None
    try:
        flags = [bool(int(f)) for f in value.split(",")]
    except ValueError:
        raise ValueError(f"--recompute takes comma-separated 0/1 flags, one per stage, got "
                         f"{value!r}") from None
    return flags


def _serve(args: argparse.Namespace) -> int:
    from merak.energy.planning.plan_file import ClockPlanError
    from merak.energy.service.pfo_server import serve

    try:
        serve(args.plan, args.host, args.port, args.results_dir,
              {"max_body_bytes": args.max_body_bytes, "concurrency": args.concurrency,
               "readers": args.readers,
               "body_timeout_s": args.body_timeout},
              max_jobs=args.max_jobs)
    except ClockPlanError as error:  # a plan that is not one, refused before serving
        raise InputError(str(error)) from None
    return 0


def _report(args: argparse.Namespace) -> int:
    from merak.energy.planning.plan_file import load_clock_plan
    from merak.energy.reporting.report import report, summarize

    try:
        lines = report(summarize(args.run_steps, args.skip),
                       summarize(args.baseline, args.skip) if args.baseline else None,
                       load_clock_plan(args.plan) if args.plan else None)
    except (OSError, ValueError) as error:
        raise InputError(str(error)) from None
    print("\n".join(lines))
    return 0
