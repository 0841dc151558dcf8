"""Profile -> plan -> deploy on 4 pipeline ranks with simulated GPUs, for 1F1B, zero-bubble
(ZB-H1), interleaved 1F1B (2 model chunks per rank) and Merak's shifted critical path (with
activation recomputation), all in one launch.

Per schedule (the procedure of bench/energy_turns.py, which bench/energy_e2e.py measures): the
clock profiler runs over training steps of the interpreter, rank 0 plans over the
interpreter's own schedule (``engine.schedule``) and the plan is deployed with `ClockPlanHook`,
taking turns step by step with all max clocks. Asserted, none of it a wall-clock figure: the
plan's instruction order is consumed exactly every step on every rank, at the planned clocks
(the baseline at the top clock), and the plan saves energy by its prediction. Measured against
predicted time and energy, and the saving as measured (per schedule) go to
``<out>/energy_report.json`` and are printed as a table; `bench/energy_e2e.py` (a run of its
own) measures them with longer instructions and checks them.

Environment (a longer run of this worker): MERAK_ENERGY_E2E_FORWARD_S (simulated forward,
default 0.03 s), MERAK_ENERGY_E2E_MICROBATCHES (default 4), MERAK_ENERGY_E2E_ROUNDS (measured
steps per plan, default 3), MERAK_ENERGY_E2E_UNIT_S (the planner's time quantum, default forward
/ 20), MERAK_ENERGY_E2E_SCHEDULES (comma-separated, default all four).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from common import out_dir, run_scenarios
from energy_turns import profile_plan_measure
from hf_models import CustomMLP, batch

import merak
from merak.energy.planning.plan_file import expected_instructions
from merak.energy.profiling.gpu import SimulatedGPU, SyntheticGPUModel
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
# Measured time and energy against the prediction are not asserted by the test: a simulated
# GPU's time is the wall clock and its idle energy follows it, which a loaded machine stretches
# beyond the profile (24% on time and 15% on energy seen under load, 1-5% on an idle machine);
# bench/energy_e2e.py checks them, and the measured saving too (the other pool's load swung
# one step of the plan against one of all max clocks by 31% in a suite run).
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


def _scenario(name: str) -> dict:
    """Profile -> plan on rank 0 -> measure the plan and all max clocks in turns: the profiled
    and the scheduled instruction kinds, the plan's order against the program's, each run's
    consumed instructions per step, and the measured report."""
    # NCCL's timing, as the planner's DAG and the simulator model it: a rank's host goes on past
    # a group that only sends (so does the suite's NCCL-contract backend: its stream completes
    # the send while the host computes)
    ctx = merak.init(dp=1, tp=1, pp=RANKS)
    engine = _engine(name, ctx)
    schedule = engine.schedule
    gpu = SimulatedGPU(MODEL, num_ranks=RANKS, chunks=schedule.stages_per_rank)
    data = _steps()
    turns = profile_plan_measure(engine, gpu, ctx, lambda: engine.train_step(next(data)),
                                 rounds=ROUNDS, unit_time=UNIT_S,
                                 profile_path=out_dir() / f"profile-{name}.csv")
    expected = expected_instructions(schedule, ctx.pp_rank)
    engine.remove_recomputation()
    report = REPORT[name] = {"schedule": name, **turns.report}
    if ctx.rank == 0:
        (out_dir() / "energy_report.json").write_text(json.dumps(REPORT, indent=1))
    return {"profiled_kinds": sorted({r.instruction for r in turns.rows
                                      if r.pp_rank == ctx.pp_rank} - {"p2p"}),
            "scheduled_kinds": sorted({a.name for a in schedule.compute_actions(ctx.pp_rank)}),
            "plan_follows_the_program": [n for n, _ in turns.mine] == expected,
            # the hook follows the plan instruction by instruction (a wrong name raises); each
            # step of both runs consumed the whole program
            "consumed": {str(key): hook.consumed for key, hook in turns.hooks.items()},
            "instructions": len(expected), "steps": ROUNDS + 1, "report": report,
            "mine": turns.mine, "max_clock": MODEL.max_clock}


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
