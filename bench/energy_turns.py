"""Profile -> plan -> measure in turns: the procedure `bench/energy_e2e.py` measures and
tests/workers/energy_e2e.py asserts on, written once.

On every pipeline rank of an interpreter with a simulated GPU: the clock profiler over training
steps, rank 0's plan over the interpreter's own schedule (broadcast to every rank, or rank 0's
error: no rank is left waiting), then the plan and all max clocks taking turns step by step
(each step between barriers, so every GPU's idle time until the slowest rank is done counts;
the minimum over the measured steps of each, which drops the steps a slow spell delayed).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from merak.energy.planning.frontier import ClockFrontier
from merak.energy.planning.plan_file import check_clock_plan, expected_instructions
from merak.energy.profiling.profile_data import aggregate, write_profile
from merak.energy.profiling.profiler import ClockProfiler, profile_clocks
from merak.energy.training.deploy import ClockPlanHook


@dataclass
class Turns:
    """What one run of `profile_plan_measure` gives: the profile's rows, this rank's plan
    (instruction, clock), each variant's hook (``all-max`` and ``plan``) and the figures."""

    rows: list
    mine: list[tuple[str, int]]
    hooks: dict[str, ClockPlanHook]
    report: dict


def plan_on_rank0(schedule, rows, ctx, unit_time: float, profile_path: Path | None = None
                  ) -> dict:
    """Rank 0 plans over `schedule` from the profile `rows` (written to `profile_path` when
    given); every rank gets the plan, or raises rank 0's error."""
    shared = [None]
    if ctx.rank == 0:
        if profile_path is not None:
            write_profile(rows, profile_path)
        try:
            profiles, p2p_power = aggregate(rows)
            planner = ClockFrontier(schedule, profiles, p2p_power, unit_time=unit_time)
            start = time.perf_counter()
            base_time, base_energy = planner.evaluate(planner.max_clock_plan())
            chosen = planner.choose(planner.frontier(), base_time)
            shared[0] = {"schedules": planner.schedules(chosen.plan), "p2p_power": p2p_power,
                         "predicted_base": [base_time, base_energy],
                         "predicted_plan": [chosen.time_s, chosen.energy_j],
                         "planner_s": time.perf_counter() - start}
        except Exception as error:  # noqa: BLE001 - reported on every rank
            shared[0] = {"error": f"planning on rank 0 failed: {type(error).__name__}: {error}"}
    dist.broadcast_object_list(shared, src=0)
    if "error" in shared[0]:
        raise RuntimeError(shared[0]["error"])
    return shared[0]


def measure_in_turns(engine, gpu, plans: dict, step: Callable[[], None], rounds: int
                     ) -> tuple[dict, dict]:
    """(iteration time, energy of every GPU) of each of `plans` (name -> this rank's clocks,
    None for all max), the minimum over `rounds` steps after a warm-up step, the plans taking
    turns step by step; and each plan's hook."""
    hooks = {name: ClockPlanHook(gpu, frequencies, engine.ctx.pp_rank)
             for name, frequencies in plans.items()}
    measured = {name: [] for name in plans}
    ran: dict[str, Counter] = {name: Counter() for name in plans}
    for round_ in range(rounds + 1):
        for name, hook in hooks.items():
            engine.hooks = [hook]
            if hook.frequencies is None:  # the baseline sets no clock: start it from the
                gpu.reset_clock()         # GPU's own (max), not the plan's last one
            dist.barrier()
            start, energy = time.perf_counter(), gpu.energy_j()
            before = Counter(getattr(gpu, "ran", {}))
            step()
            dist.barrier()
            ran[name] += Counter(getattr(gpu, "ran", {})) - before
            if round_:  # the first is a warm-up
                measured[name].append([time.perf_counter() - start, gpu.energy_j() - energy])
    engine.hooks = []
    result = {}
    for name, values in measured.items():
        local = torch.tensor(values, dtype=torch.float64)
        times, energies = local[:, 0].clone(), local[:, 1].clone()
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(energies)
        result[name] = [times.min().item(), energies.min().item()]
    return result, hooks, {name: sorted([*key, count] for key, count in counts.items())
                           for name, counts in ran.items()}


def profile_plan_measure(engine, gpu, ctx, step: Callable[[], None], *, rounds: int,
                         unit_time: float, profile_path: Path | None = None) -> Turns:
    """The whole procedure on `engine` (its hooks are cleared after) with `step` one training
    step; the figures of `Turns.report` are every rank's."""
    schedule = engine.schedule
    began = time.perf_counter()
    profiler = ClockProfiler(gpu, ctx.pp_rank)
    engine.hooks = [profiler]
    rows = profile_clocks(step, profiler, ctx)
    engine.hooks = []
    profiled = time.perf_counter()
    plan = plan_on_rank0(schedule, rows, ctx, unit_time, profile_path)
    planned = time.perf_counter()
    mine = check_clock_plan(plan["schedules"], ctx.world_size, lambda r: r, schedule,
                            gpu.supported_clocks())[ctx.rank]
    measured, hooks, ran = measure_in_turns(engine, gpu, {"all-max": None, "plan": mine}, step,
                                            rounds)
    base_energy, plan_energy = plan["predicted_base"][1], plan["predicted_plan"][1]
    report = {"chunks": schedule.stages_per_rank,
              "instructions": [len(expected_instructions(schedule, r))
                               for r in range(ctx.pp)],
              "profiled_clocks": len({r.frequency for r in rows if r.instruction == "forward"}),
              "p2p_power": plan["p2p_power"], "planner_s": plan["planner_s"],
              "profile_s": profiled - began, "plan_s": planned - profiled,
              "measure_s": time.perf_counter() - planned,
              "predicted_base": plan["predicted_base"], "measured_base": measured["all-max"],
              "predicted_plan": plan["predicted_plan"], "measured_plan": measured["plan"],
              "planned_saving": 1 - plan_energy / base_energy,
              "measured_saving": 1 - measured["plan"][1] / measured["all-max"][1],
              "clocks_ran": ran}
    return Turns(rows, mine, hooks, report)
