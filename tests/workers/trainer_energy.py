"""MerakTrainer's energy modes on 2 ranks (pp=2, simulated GPUs): profile -> `merak energy plan`
-> train with the plan from a file and from `merak energy serve`; clock plans never change the
numbers (losses equal a run without them); malformed plans stop training before its first step;
zero-bubble with activation checkpointing profiles, plans (with the command the trainer prints)
and follows recompute and split-backward instructions. Each scenario returns what it saw;
test_energy_service asserts it."""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as tf
from common import Compared, run_scenarios
from hf_models import VOCAB
from trainer_common import dataset

import merak
from merak.energy.planning.plan_file import ClockPlanError, load_clock_plan
from merak.energy.profiling.profile_data import read_profile
from merak.energy.reporting.report import report, summarize

STEPS, SEED = 6, 5
SIMULATED = json.dumps({"forward_s": 0.02, "clock_step": 90})  # 6 clocks, 1410..960 MHz
OUT = Path(sys.argv[sys.argv.index("--out") + 1])
PLAN = OUT / "plan.json"
RUNS: dict[str, dict[int, float]] = {}


def trainer(name: str, **kwargs) -> merak.MerakTrainer:
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0))
    options = {"max_steps": STEPS, "per_device_train_batch_size": 2,
               "gradient_accumulation_steps": 2, "learning_rate": 1e-3, "logging_steps": 1,
               "seed": SEED, "report_to": "none", "disable_tqdm": True, "use_cpu": True,
               "save_strategy": "no", "train_sampling_strategy": "sequential"}
    if kwargs:
        options.update(energy_gpu="simulated", simulated_gpu=SIMULATED)
    args = merak.MerakArguments(output_dir=str(OUT / name), **{**options, **kwargs})
    return merak.MerakTrainer(model=model, args=args, train_dataset=dataset(4 * STEPS, 3))


def losses(t: merak.MerakTrainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}


def train(name: str, compared: Compared | None = None, **kwargs) -> merak.MerakTrainer:
    """A run; with `compared`, its logged losses next to the run without clocks' (clocks change
    energy, never the numbers; each log holds the mean of its window)."""
    t = trainer(name, **kwargs)
    t.train()
    dist.barrier()  # rank 0 has written energy_steps.csv
    RUNS[name] = losses(t)
    if compared is not None:
        every = kwargs.get("logging_steps", 1)
        for step, loss in RUNS[name].items():
            plain = sum(RUNS["plain"][s] for s in range(step - every + 1, step + 1)) / every
            compared.value(f"{name} step {step} loss", loss, plain)
    return t


def steps_file(name: str) -> Path:
    return OUT / name / "energy_steps.csv"


def profile_then_plan_from_a_file() -> dict:
    """Runs without clocks, at all-max clocks, profiling, and with the plan `merak energy plan`
    made from the profile: their losses (`Compared`), what each logged and ran at which clock,
    the profile's rows and the plan command's outcome (rank 0)."""
    compared = Compared()
    train("plain")
    measured = train("all-max", compared, energy_plan=None)
    profiled = trainer("profile", energy_profile=str(OUT / "profile.csv")).train()
    figures = {"all_max_logs_energy": all("step_energy_j" in h for h in
                                          measured.state.log_history if "loss" in h),
               "profiled_clocks": profiled.metrics["profiled_clocks"]}
    if dist.get_rank() == 0:
        rows = read_profile(OUT / "profile.csv")
        plan = subprocess.run([sys.executable, "-m", "merak", "energy", "plan",
                               str(OUT / "profile.csv"), "--stages", "2", "--microbatches", "2",
                               "--out", str(PLAN)], capture_output=True, text=True, check=False)
        print(plan.stdout)
        figures.update(profile_stages=sorted({r.stage for r in rows}),
                       profile_instructions=sorted({r.instruction for r in rows}),
                       plan_returncode=plan.returncode, plan_stderr=plan.stderr[-3000:])
    dist.barrier()
    if not PLAN.exists():  # (the figures say why)
        return compared.figures(**figures, plan_written=False)
    planned = train("planned", compared, energy_plan=str(PLAN))
    with steps_file("planned").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    run, base = summarize(steps_file("planned")), summarize(steps_file("all-max"))
    lines = report(run, base, load_clock_plan(PLAN))
    if dist.get_rank() == 0:
        print("\n".join(lines))
    # every step ran every instruction at its planned clock (the all-max run at the highest);
    # that the plan saves energy is measured by test_energy_planning's end-to-end run, whose
    # plans take turns step by step: two trainer runs one after the other see different loads
    # of the shared machine (step times swinging 3x), so their energies are not compared here
    planned_ran = Counter({(n, f): STEPS * c for (n, f), c in
                           Counter(map(tuple, planned.energy.hook.frequencies)).items()})
    return compared.figures(
        **figures, plan_written=True, steps_in_file=steps,
        ran_as_planned=planned.energy.gpu.ran == planned_ran,
        all_max_clocks=sorted({f for _, f in measured.energy.gpu.ran}),
        plan_clocks=sorted({f for s in load_clock_plan(PLAN)["schedules"]
                            for _, f in s["frequencies"]}))


def _serving(plan: dict, run) -> object:
    """Run `run(url)` on every rank against a server in rank 0's process; returns its registry."""
    from merak.energy.service.pfo_server import PlanRegistry, ServerThread

    registry = PlanRegistry([plan]) if dist.get_rank() == 0 else None
    with ServerThread(registry) if registry else contextlib.nullcontext() as server:
        url = [server.url if server else None]
        dist.broadcast_object_list(url, src=0)
        try:
            run(url[0])
        finally:
            dist.barrier()  # every rank is done with the server before it stops
    return registry


def plan_from_a_server() -> dict:
    """A run that takes its plan from `merak energy serve` in rank 0's process: its losses
    against the run without clocks, and what the server's registry recorded (rank 0)."""
    compared = Compared()
    registry = _serving(load_clock_plan(PLAN), lambda url: train(
        "served", compared, pfo_server_url=url, logging_steps=2))
    figures = {}
    if registry is not None:
        figures["jobs"] = len(registry.jobs)
        for job in registry.jobs.values():
            figures.update(job_ranks=sorted(job.ranks),
                           result_ranks=sorted(r.rank for r in job.results),
                           energies_per_result=[len(r.iter_energy) for r in job.results])
    return compared.figures(**figures)


def _refused(**kwargs) -> dict:
    """How a run with a bad plan ended: the ClockPlanError's message, the steps it took, and
    whether it wrote a steps file."""
    t = trainer("refused", **kwargs)
    try:
        t.train()
        error = None
    except ClockPlanError as refused:
        error = str(refused)
    return {"error": error, "steps": t.state.global_step,
            "steps_file": steps_file("refused").exists()}


def malformed_plans_stop_before_training() -> dict:
    """Each malformed plan's run (from a file, and one from a server): see `_refused`."""
    good = load_clock_plan(PLAN)
    bad = {"ranks": {**good, "schedules": good["schedules"][:1]},
           "ranks-no-meta": {**{k: v for k, v in good.items() if k != "meta"},
                             "schedules": good["schedules"][:1]},
           "order": {**good, "schedules": [{**s, "frequencies": s["frequencies"][::-1]}
                                           for s in good["schedules"]]},
           "clock": {**good, "schedules": [{**s, "frequencies": [[n, 1400] for n, _ in
                                                                 s["frequencies"]]}
                                           for s in good["schedules"]]}}
    for name, plan in bad.items():
        (OUT / f"bad-{name}.json").write_text(json.dumps(plan))
    dist.barrier()
    runs = {name: _refused(energy_plan=str(OUT / f"bad-{name}.json")) for name in bad}
    served = []
    _serving(bad["order"], lambda url: served.append(_refused(pfo_server_url=url)))
    return {**runs, "served-order": served[0]}


def every_instruction_kind() -> dict:
    """The plan's instructions are the interpreter's own (`TrainerEnergy.attach`): recompute,
    backward_input and backward_weight get clocks of their own."""
    extra = {"train_schedule": "zero_bubble", "activation_checkpointing": True}
    profile, plan = OUT / "zb-profile.csv", OUT / "zb-plan.json"
    profiled = trainer("zb-profile", energy_profile=str(profile), **extra)
    profiled.train()
    command = profiled.energy.plan_command(profile).split()
    figures = {"command": command, "profile": str(profile)}
    if dist.get_rank() == 0:
        run = subprocess.run([sys.executable, "-m", *command, "--out", str(plan)],
                             capture_output=True, text=True, check=False)
        figures.update(profile_instructions=sorted({r.instruction
                                                    for r in read_profile(profile)}),
                       plan_returncode=run.returncode, plan_stderr=run.stderr[-3000:])
    dist.barrier()
    if not plan.exists():  # (the figures say why)
        return figures
    planned = trainer("zb-planned", energy_plan=str(plan), **extra)
    planned.train()
    schedule = planned.engine.interpreter.schedule
    return {**figures,
            "schedule_actions": [a.name for a in schedule.compute_actions(planned.ctx.pp_rank)],
            "planned_actions": [n for n, _ in planned.energy.hook.frequencies],
            "consumed": planned.energy.hook.consumed}


SCENARIOS = {"profile-then-plan-from-a-file": profile_then_plan_from_a_file,
             "plan-from-a-server": plan_from_a_server,
             "malformed-plans-stop-before-training": malformed_plans_stop_before_training,
             "every-instruction-kind": every_instruction_kind}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)
