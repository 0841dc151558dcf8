"""MerakTrainer's energy modes on 2 ranks (pp=2, simulated GPUs): profile -> `merak energy plan`
-> train with the plan from a file and from `merak energy serve`; clock plans never change the
numbers (losses equal a run without them); malformed plans stop training before its first step;
zero-bubble with activation checkpointing profiles, plans (with the command the trainer prints)
and follows recompute and split-backward instructions (see test_energy_service)."""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from common import run_scenarios
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


def train(name: str, **kwargs) -> merak.MerakTrainer:
    t = trainer(name, **kwargs)
    t.train()
    dist.barrier()  # rank 0 has written energy_steps.csv
    RUNS[name] = losses(t)
    if "plain" in RUNS and name != "plain":  # clocks change energy, never the numbers
        every = kwargs.get("logging_steps", 1)  # each log holds the mean of its window
        plain = {step: sum(RUNS["plain"][s] for s in range(step - every + 1, step + 1)) / every
                 for step in RUNS[name]}
        assert RUNS[name] == pytest.approx(plain, rel=1e-6), (name, RUNS[name], plain)
    return t


def steps_file(name: str) -> Path:
    return OUT / name / "energy_steps.csv"


def profile_then_plan_from_a_file() -> None:
    train("plain")
    measured = train("all-max", energy_plan=None)
    assert all("step_energy_j" in h for h in measured.state.log_history if "loss" in h)
    profiled = trainer("profile", energy_profile=str(OUT / "profile.csv")).train()
    assert profiled.metrics["profiled_clocks"] >= 3, profiled.metrics
    if dist.get_rank() == 0:
        rows = read_profile(OUT / "profile.csv")
        assert {r.stage for r in rows} == {0, 1}
        assert {r.instruction for r in rows} == {"forward", "backward", "p2p"}
        plan = subprocess.run([sys.executable, "-m", "merak", "energy", "plan",
                               str(OUT / "profile.csv"), "--stages", "2", "--microbatches", "2",
                               "--out", str(PLAN)], capture_output=True, text=True, check=False)
        assert plan.returncode == 0 and PLAN.exists(), (plan.stdout, plan.stderr[-3000:])
        print(plan.stdout)
    dist.barrier()
    planned = train("planned", energy_plan=str(PLAN))
    with steps_file("planned").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    run, base = summarize(steps_file("planned")), summarize(steps_file("all-max"))
    lines = report(run, base, load_clock_plan(PLAN))
    if dist.get_rank() == 0:
        print("\n".join(lines))
    # every step ran every instruction at its planned clock (the all-max run at the highest);
    # that the plan saves energy is measured by test_energy_planning's end-to-end run, whose
    # plans take turns step by step: two trainer runs one after the other see different loads
    # of the shared machine (step times swinging 3x), so their energies are not compared here
    mine = planned.energy.hook.frequencies
    assert planned.energy.gpu.ran == Counter({(n, f): STEPS * c for (n, f), c in
                                              Counter(map(tuple, mine)).items()}), lines
    assert {f for _, f in measured.energy.gpu.ran} == {1410}
    clocks = {f for s in load_clock_plan(PLAN)["schedules"] for _, f in s["frequencies"]}
    assert min(clocks) < 1410, clocks  # the plan lowers some clocks


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


def plan_from_a_server() -> None:
    registry = _serving(load_clock_plan(PLAN), lambda url: train(
        "served", pfo_server_url=url, logging_steps=2))
    if registry is not None:
        (job,) = registry.jobs.values()
        assert sorted(job.ranks) == [0, 1]
        assert sorted(r.rank for r in job.results) == [0, 0, 0, 1, 1, 1]  # 3 windows of 2
        assert all(len(r.iter_energy) == 2 for r in job.results)


def _refused(match: str, **kwargs) -> None:
    t = trainer("refused", **kwargs)
    with pytest.raises(ClockPlanError, match=match):
        t.train()
    assert t.state.global_step == 0 and not steps_file("refused").exists()


def malformed_plans_stop_before_training() -> None:
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
    _refused(r"meta.stages must be a pipeline degree dividing its 1 ranks",  # when read
             energy_plan=str(OUT / "bad-ranks.json"))
    _refused(r"schedules for ranks \[0\], this job has 2 ranks",  # against the job
             energy_plan=str(OUT / "bad-ranks-no-meta.json"))
    _refused(r"instruction order differs from the schedule at position 0",
             energy_plan=str(OUT / "bad-order.json"))
    _refused(r"clocks \[1400\] MHz are not supported", energy_plan=str(OUT / "bad-clock.json"))
    _serving(bad["order"], lambda url: _refused(r"instruction order differs",
                                                pfo_server_url=url))


def every_instruction_kind() -> None:
    """The plan's instructions are the interpreter's own (`TrainerEnergy.attach`): recompute,
    backward_input and backward_weight get clocks of their own."""
    extra = {"train_schedule": "zero_bubble", "activation_checkpointing": True}
    profile, plan = OUT / "zb-profile.csv", OUT / "zb-plan.json"
    profiled = trainer("zb-profile", energy_profile=str(profile), **extra)
    profiled.train()
    command = profiled.energy.plan_command(profile).split()
    assert command[:4] == ["merak", "energy", "plan", str(profile)], command
    assert command[4:] == ["--schedule", "zero_bubble", "--stages", "2", "--microbatches", "2",
                           "--recompute"], command
    if dist.get_rank() == 0:
        kinds = {r.instruction for r in read_profile(profile)}
        assert kinds == {"forward", "recompute", "backward_input", "backward_weight", "p2p"}
        run = subprocess.run([sys.executable, "-m", *command, "--out", str(plan)],
                             capture_output=True, text=True, check=False)
        assert run.returncode == 0 and plan.exists(), (run.stdout, run.stderr[-3000:])
    dist.barrier()
    planned = trainer("zb-planned", energy_plan=str(plan), **extra)
    planned.train()
    schedule = planned.engine.interpreter.schedule
    expected = [a.name for a in schedule.compute_actions(planned.ctx.pp_rank)]
    assert [n for n, _ in planned.energy.hook.frequencies] == expected
    assert planned.energy.hook.consumed == [len(expected)] * STEPS
    assert {"recompute", "backward_input", "backward_weight"} <= set(expected)


SCENARIOS = {"profile-then-plan-from-a-file": profile_then_plan_from_a_file,
             "plan-from-a-server": plan_from_a_server,
             "malformed-plans-stop-before-training": malformed_plans_stop_before_training,
             "every-instruction-kind": every_instruction_kind}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)
