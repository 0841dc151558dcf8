"""Profile -> plan -> deploy on a 4-stage, 8-micro-batch 1f1b pipeline with simulated GPUs:
measured iteration time and energy must match the planner's prediction within 1%, and the
default plan must save >= 8% energy at <= 0.5% slowdown against all max clocks."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from common import run_scenarios
from hf_models import CustomMLP, batch

import merak
from merak.energy.deploy import ClockPlanHook
from merak.energy.gpu import SimulatedGPU, SyntheticGPUModel
from merak.energy.plan_file import check_plan
from merak.energy.planner import EnergyPlanner
from merak.energy.profile_data import aggregate, write_profile
from merak.energy.profiler import ClockProfiler, profile_clocks

STAGES, MICROBATCHES, ROWS = 4, 8, 1
MODEL = SyntheticGPUModel(clock_step=45, forward_s=0.2)  # long next to p2p latency (~1 ms)


def _engine(stage, ctx, hooks):
    return merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=0.01),
                                     MICROBATCHES, schedule="1f1b", hooks=hooks,
                                     lend_idle_cores=False)


def _measure(stage, ctx, gpu, plans: dict, rounds: int = 4) -> dict:
    """(iteration time, energy of every GPU) of each plan: the minimum over `rounds` steps, after
    a warm-up step, each step between barriers so that every GPU's idle time until the slowest
    stage finishes is counted. The plans take turns step by step, so a slow spell of the 2-core
    machine hits all of them alike; the minimum drops the steps it delayed (a delay only ever
    adds time and idle energy to a simulated GPU, never removes any)."""
    engines = {name: _engine(stage, ctx, [ClockPlanHook(gpu, frequencies, ctx.stage_id)])
               for name, frequencies in plans.items()}
    for engine in engines.values():
        engine.train_step(batch("mlp", 0, ROWS * MICROBATCHES))
    measured = {name: [] for name in plans}
    for step in range(rounds):
        for name, engine in engines.items():
            dist.barrier()
            start, energy = time.perf_counter(), gpu.energy_j()
            engine.train_step(batch("mlp", step, ROWS * MICROBATCHES))
            dist.barrier()
            measured[name].append([time.perf_counter() - start, gpu.energy_j() - energy])
    result = {}
    for name, values in measured.items():
        local = torch.tensor(values, dtype=torch.float64)
        times, energies = local[:, 0].clone(), local[:, 1].clone()
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(energies)
        result[name] = (times.min().item(), energies.min().item())
    return result


def end_to_end() -> None:
    ctx = merak.init(dp=1, tp=1, pp=STAGES)
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = CustomMLP(depth=8)
    stage = merak.parallelize(model, batch("mlp", 0, ROWS), ctx)
    gpu = SimulatedGPU(MODEL, num_stages=STAGES)

    profiler = ClockProfiler(gpu, ctx.stage_id)
    engine = _engine(stage, ctx, [profiler])
    steps = iter(range(100))
    rows = profile_clocks(lambda: engine.train_step(batch("mlp", next(steps), ROWS * MICROBATCHES)),
                          profiler, ctx)
    profiles, p2p_power = aggregate(rows)
    schedule = merak.make_schedule("1f1b", STAGES, MICROBATCHES)
    planner = EnergyPlanner(schedule, profiles, p2p_power, unit_time=2.5e-3)
    base_time, base_energy = planner.evaluate(planner.max_clock_plan())
    chosen = planner.choose(planner.frontier(), base_time)
    plan = check_plan(planner.schedules(chosen.plan), ctx.world_size, lambda r: r, schedule,
                      gpu.supported_clocks())

    measured = _measure(stage, ctx, gpu, {"all-max": None, "plan": plan[ctx.rank]})
    measured_base, measured_plan = measured["all-max"], measured["plan"]
    report = {"profiled_clocks": len({r.frequency for r in rows if r.instruction == "forward"}),
              "p2p_power": p2p_power,
              "predicted_base": [base_time, base_energy], "measured_base": measured_base,
              "predicted_plan": [chosen.time_s, chosen.energy_j], "measured_plan": measured_plan}
    if ctx.rank == 0:
        out = os.environ.get("MERAK_ENERGY_REPORT")
        if out:
            write_profile(rows, out + ".csv")
            with open(out, "w") as f:
                json.dump(report, f, indent=1)
    for what, predicted, measured in (("all-max", (base_time, base_energy), measured_base),
                                      ("plan", (chosen.time_s, chosen.energy_j), measured_plan)):
        for i, unit in enumerate(("time", "energy")):
            error = abs(measured[i] / predicted[i] - 1)
            assert error <= 0.01, (f"{what} {unit}: measured {measured[i]:.4f}, predicted "
                                   f"{predicted[i]:.4f} ({error:.2%} off); {report}")
    saving = 1 - measured_plan[1] / measured_base[1]
    slowdown = measured_plan[0] / measured_base[0] - 1
    assert saving >= 0.08, f"the plan saves {saving:.2%} energy, expected >= 8%; {report}"
    assert slowdown <= 0.005, f"the plan is {slowdown:.2%} slower, expected <= 0.5%; {report}"


SCENARIOS = {"energy-end-to-end": end_to_end}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)
