"""Profile -> plan -> deploy on 4 pipeline ranks with simulated GPUs, for 1F1B, zero-bubble
(ZB-H1), interleaved 1F1B (2 model chunks per rank) and Merak's shifted critical path (with
activation recomputation), all in one launch.

Per schedule: the clock profiler runs over training steps of the interpreter, rank 0 plans over
the interpreter's own schedule (``engine.schedule``) and the plan is deployed with
`ClockPlanHook`, taking turns step by step with all max clocks. Asserted, with margins a shared
2-core machine's noise cannot break: the plan's instruction order is consumed exactly every step
on every rank, and the plan measurably saves energy against all max clocks at about their speed
(measured in the same run, step by step in turns). Measured against predicted time and energy
(per schedule, with the planned saving) go to ``<out>/energy_report.json`` and are printed as a
table; `bench/energy_e2e.py` (a run of its own) measures them with longer instructions and
checks them.

Environment (a longer run of this worker): MERAK_ENERGY_E2E_FORWARD_S (simulated forward,
default 0.03 s), MERAK_ENERGY_E2E_MICROBATCHES (default 4), MERAK_ENERGY_E2E_ROUNDS (measured
steps per plan, default 3), MERAK_ENERGY_E2E_UNIT_S (the planner's time quantum, default forward
/ 20), MERAK_ENERGY_E2E_SCHEDULES (comma-separated, default all four).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from common import out_dir, run_scenarios
from hf_models import CustomMLP, batch

import merak
from merak.energy.planning.frontier import ClockFrontier
from merak.energy.planning.plan_file import check_clock_plan, expected_instructions
from merak.energy.profiling.gpu import SimulatedGPU, SyntheticGPUModel
from merak.energy.profiling.profile_data import aggregate, write_profile
from merak.energy.profiling.profiler import ClockProfiler, profile_clocks
from merak.energy.training.deploy import ClockPlanHook
from merak.schedule.registry import SCHEDULES

RANKS, ROWS = 4, 1
FORWARD_S = float(os.environ.get("MERAK_ENERGY_E2E_FORWARD_S", "0.03"))
MICROBATCHES = int(os.environ.get("MERAK_ENERGY_E2E_MICROBATCHES", "4"))
ROUNDS = int(os.environ.get("MERAK_ENERGY_E2E_ROUNDS", "3"))
UNIT_S = float(os.environ.get("MERAK_ENERGY_E2E_UNIT_S", FORWARD_S / 20))  # the solver's quantum
SCHEDULE_NAMES = os.environ.get(
    "MERAK_ENERGY_E2E_SCHEDULES",
    "1f1b,zero_bubble,interleaved_1f1b,shifted_critical_path").split(",")
CHUNKS = 2  # model chunks per rank for interleaved_1f1b
MODEL = SyntheticGPUModel(clock_step=90, forward_s=FORWARD_S)  # 6 clocks, 1410..960 MHz
# Measured time and energy against the prediction are not asserted here: a simulated GPU's time
# is the wall clock and its idle energy follows it, which a loaded machine stretches beyond the
# profile (24% on time and 15% on energy seen under load, 1-5% on an idle machine);
# bench/energy_e2e.py checks them. The plan against all max clocks, measured in the same steps
# taken in turns, is asserted.
REPORT: dict[str, dict] = {}


def _engine(name: str, ctx) -> merak.PipelineInterpreter:
    info = SCHEDULES[name]
    chunks = CHUNKS if info.several_stages_per_rank else 1
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = CustomMLP(depth=8)
    stage = merak.parallelize(model, batch("mlp", 0, ROWS), ctx, num_model_chunks=chunks)
    return merak.PipelineInterpreter(
        stage, ctx, torch.optim.SGD(stage.parameters(), lr=0.01), num_microbatches=MICROBATCHES,
        schedule=name,
        recompute_ratio=1.0 if info.needs_recompute else 0.0, lend_idle_cores=False)


def _steps():
    step = 0
    while True:
        yield batch("mlp", step, ROWS * MICROBATCHES)
        step += 1


def _plan(name: str, engine, rows, ctx) -> dict:
    """Rank 0 plans over the interpreter's own schedule; every rank gets the plan (or rank 0's
    error: no rank is left waiting)."""
    shared = [None]
    if ctx.rank == 0:
        write_profile(rows, out_dir() / f"profile-{name}.csv")
        try:
            profiles, p2p_power = aggregate(rows)
            planner = ClockFrontier(engine.schedule, profiles, p2p_power,
                                    unit_time=UNIT_S)
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


def _measure(engine, gpu, plans: dict, data) -> tuple[dict, dict]:
    """(iteration time, energy of every GPU) of each plan: the minimum over `ROUNDS` steps, after
    a warm-up step, each step between barriers so that every GPU's idle time until the slowest
    rank finishes is counted. The plans take turns step by step, so a slow spell of the machine
    hits all of them alike; the minimum drops the steps it delayed (a delay only ever adds time
    and idle energy to a simulated GPU). Also returns each plan's hook."""
    hooks = {name: ClockPlanHook(gpu, frequencies, engine.ctx.pp_rank)
             for name, frequencies in plans.items()}
    measured = {name: [] for name in plans}
    for step in range(ROUNDS + 1):
        for name, hook in hooks.items():
            engine.hooks = [hook]
            if hook.frequencies is None:  # the baseline sets no clock: start it from the
                gpu.reset_clock()         # GPU's own (max), not the plan's last one
            dist.barrier()
            start, energy = time.perf_counter(), gpu.energy_j()
            engine.train_step(next(data))
            dist.barrier()
            if step:  # the first is a warm-up
                measured[name].append([time.perf_counter() - start, gpu.energy_j() - energy])
    engine.hooks = []
    result = {}
    for name, values in measured.items():
        local = torch.tensor(values, dtype=torch.float64)
        times, energies = local[:, 0].clone(), local[:, 1].clone()
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(energies)
        result[name] = (times.min().item(), energies.min().item())
    return result, hooks


def _scenario(name: str) -> None:
    # NCCL's timing, as the planner's DAG and the simulator model it: a rank's host goes on past
    # a group that only sends (so does the suite's NCCL-contract backend: its stream completes
    # the send while the host computes)
    ctx = merak.init(dp=1, tp=1, pp=RANKS)
    engine = _engine(name, ctx)
    schedule = engine.schedule
    gpu = SimulatedGPU(MODEL, num_ranks=RANKS, chunks=schedule.stages_per_rank)
    data = _steps()
    began = time.perf_counter()
    profiler = ClockProfiler(gpu, ctx.pp_rank)
    engine.hooks = [profiler]
    rows = profile_clocks(lambda: engine.train_step(next(data)), profiler, ctx)
    engine.hooks = []
    kinds = {r.instruction for r in rows if r.pp_rank == ctx.pp_rank} - {"p2p"}
    assert kinds == {a.name for a in schedule.compute_actions(ctx.pp_rank)}, kinds

    profiled = time.perf_counter()
    plan = _plan(name, engine, rows, ctx)
    planned = time.perf_counter()
    mine = check_clock_plan(plan["schedules"], ctx.world_size, lambda r: r, schedule,
                            gpu.supported_clocks())[ctx.rank]
    expected = expected_instructions(schedule, ctx.pp_rank)
    assert [n for n, _ in mine] == expected
    measured, hooks = _measure(engine, gpu, {"all-max": None, "plan": mine}, data)
    walls = {"profile_s": profiled - began, "plan_s": planned - profiled,
             "measure_s": time.perf_counter() - planned}
    # the hook follows the plan instruction by instruction (a wrong name raises) and checks
    # that each step consumed it exactly; every step of both runs ran the whole program
    for hook in hooks.values():
        assert hook.consumed == [len(expected)] * (ROUNDS + 1), (hook.consumed, len(expected))
    engine.remove_recomputation()

    (base_time, base_energy), (plan_time, plan_energy) = \
        plan["predicted_base"], plan["predicted_plan"]
    report = {"schedule": name, "chunks": schedule.stages_per_rank,
              "instructions": [len(expected_instructions(schedule, r)) for r in range(RANKS)],
              "profiled_clocks": len({r.frequency for r in rows if r.instruction == "forward"}),
              "p2p_power": plan["p2p_power"], "planner_s": plan["planner_s"], **walls,
              "predicted_base": [base_time, base_energy], "measured_base": measured["all-max"],
              "predicted_plan": [plan_time, plan_energy], "measured_plan": measured["plan"],
              "planned_saving": 1 - plan_energy / base_energy,
              "measured_saving": 1 - measured["plan"][1] / measured["all-max"][1]}
    REPORT[name] = report
    if ctx.rank == 0:
        (out_dir() / "energy_report.json").write_text(json.dumps(REPORT, indent=1))
    assert report["planned_saving"] >= 0.03, report
    # the plan must save energy as measured (at least a quarter of the planned saving: a loaded
    # machine's delays add idle energy to both runs) at about all-max speed
    assert report["measured_saving"] >= report["planned_saving"] / 4, report
    assert measured["plan"][0] <= measured["all-max"][0] * 1.15, report


def table(report: dict[str, dict]) -> str:
    """The per-schedule figures, one line each, with the saving next to 1F1B's."""
    lines = [f"{'schedule':24}{'all-max s':>10}{'J':>8}{'plan s':>9}{'J':>8}"
             f"{'planned':>9}{'measured':>9}{'vs 1f1b':>9}{'t err':>8}{'E err':>8}"]
    reference = report.get("1f1b", {}).get("planned_saving")
    for name, r in report.items():
        base, plan = r["measured_base"], r["measured_plan"]
        t_err = max(abs(r["measured_plan"][0] / r["predicted_plan"][0] - 1),
                    abs(r["measured_base"][0] / r["predicted_base"][0] - 1))
        e_err = max(abs(r["measured_plan"][1] / r["predicted_plan"][1] - 1),
                    abs(r["measured_base"][1] / r["predicted_base"][1] - 1))
        versus = f"{r['planned_saving'] - reference:+.2%}" if reference is not None else "-"
        label = name + (f" (v={r['chunks']})" if r["chunks"] > 1 else "")
        lines.append(f"{label:24}{base[0]:10.4f}{base[1]:8.1f}{plan[0]:9.4f}{plan[1]:8.1f}"
                     f"{r['planned_saving']:9.2%}{r['measured_saving']:9.2%}{versus:>9}"
                     f"{t_err:8.2%}{e_err:8.2%}")
    return "\n".join(lines)


def summary() -> None:
    if dist.get_rank() == 0 and REPORT:
        print("energy end to end (measured; saving: energy saved by the plan vs all max "
              "clocks; err: worst measured vs predicted)\n" + table(REPORT), flush=True)


SCENARIOS = {f"energy-end-to-end-{name}": (lambda name=name: _scenario(name))
             for name in SCHEDULE_NAMES}
SCENARIOS["energy-end-to-end-summary"] = summary


def scenarios(world_size: int) -> dict:
    assert world_size == RANKS, f"energy_e2e runs on {RANKS} ranks, not {world_size}"
    return SCENARIOS


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
