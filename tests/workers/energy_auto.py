"""``energy_mode="auto"`` on 4 pipeline ranks with simulated GPUs, for 1F1B, zero-bubble and
interleaved 1F1B (2 model chunks per rank), in one launch.

Per schedule, MerakTrainer trains a tiny GPT-2 with ``energy_mode="auto"`` until a few steps
after the plan is deployed (a callback ends the run: how many steps the background planner takes
depends on the machine), then the same number of steps without energy control. Returned, for
test_energy_training to assert: the loss curves of both (clocks change time, not arithmetic);
the profile's steps per round (at most 1 + 8); the step each rank deployed the plan at and how
much of the plan every planned step ran; the files (profile, plan and its frontier picture, the
steps and their plot) and the final metrics (the saving). 1F1B also slows the simulated GPU
down 2x once the plan is deployed: the measured step time drifts past the plan's prediction (by
more than the 50% margin this run sets; the others set 100%, beyond a loaded machine's noise)
and the run re-plans.

Measured energy and time are not asserted (the simulated GPU runs on the wall clock of a shared
machine); each schedule's measured saving against its plan's prediction goes to
``<out>/energy_auto_report.json`` and is printed. `bench/energy_auto.py` (a run of its own)
measures them with longer instructions and checks them: at least 90% of the predicted saving,
the time within ``energy_max_slowdown`` + 1%.

Environment (a longer run of this worker): MERAK_ENERGY_AUTO_FORWARD_S (simulated forward,
default 0.02 s), MERAK_ENERGY_AUTO_AFTER (planned steps measured, default 4),
MERAK_ENERGY_AUTO_DRIFT (0: no slow-down), MERAK_ENERGY_AUTO_SCHEDULES (comma-separated).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter

import torch
import torch.distributed as dist
import transformers as tf
from common import Compared, out_dir, run_scenarios
from hf_models import VOCAB
from trainer_common import dataset

import merak
from merak.distributed.host_objects import all_gather_objects
from merak.energy.planning.plan_file import expected_instructions
from merak.energy.training.auto import PROFILE_CLOCKS

FORWARD_S = float(os.environ.get("MERAK_ENERGY_AUTO_FORWARD_S", "0.02"))
AFTER = int(os.environ.get("MERAK_ENERGY_AUTO_AFTER", "4"))
DRIFT = os.environ.get("MERAK_ENERGY_AUTO_DRIFT", "1") != "0"
# the suite: 1F1B (with the drift) and interleaved 1F1B (a plan over 2 chunks per rank);
# zero-bubble too with MERAK_TEST_MATRIX=full (the schedule's plan is energy_e2e's as well)
SCHEDULE_NAMES = os.environ.get(
    "MERAK_ENERGY_AUTO_SCHEDULES",
    "1f1b,zero_bubble,interleaved_1f1b" if os.environ.get("MERAK_TEST_MATRIX") == "full"
    else "1f1b,interleaved_1f1b").split(",")
RANKS, MICROBATCHES, SEED, LIMIT = 4, 4, 3, 250
SIMULATED = json.dumps({"forward_s": FORWARD_S, "clock_step": 90})  # 6 clocks
REPORT: dict[str, dict] = {}


class StopAfterThePlan(tf.TrainerCallback):
    """Ends the run `AFTER` steps into the last plan (the same step on every rank: the plans
    are deployed at the same step); with `drift`, slows the simulated GPU down 2x from the
    second step of the first plan on."""

    def __init__(self, drift: bool):
        self.trainer, self.drift = None, drift

    def on_step_end(self, args, state, control, **kwargs):
        auto = self.trainer.energy.auto
        if not auto.plans or auto.phase != "planned":
            return
        deployed = auto.plans[-1]["step"]
        if self.drift and len(auto.plans) == 1 and state.global_step == deployed:
            gpu = self.trainer.energy.gpu
            gpu.model = dataclasses.replace(gpu.model, forward_s=gpu.model.forward_s * 2)
        if state.global_step >= deployed + AFTER - 1 and (len(auto.plans) > 1 or not self.drift):
            control.should_training_stop = True


def _trainer(name: str, schedule: str, steps: int, cp: int = 1,
             **energy) -> merak.MerakTrainer:
    merak.init(dp=1, tp=1, pp=RANKS // cp, cp=cp)
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        dropout = {"attn_pdrop": 0.0} if cp > 1 else {}  # (ring attention has none)
        model = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(
            n_embd=16, n_layer=8, n_head=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
            **dropout))
    chunks = {"num_model_chunks": 2} if schedule == "interleaved_1f1b" else {}
    args = merak.MerakArguments(
        output_dir=str(out_dir() / name), max_steps=steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=MICROBATCHES, learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=1, seed=SEED, report_to="none",
        disable_tqdm=True, use_cpu=True, save_strategy="no", train_sampling_strategy="sequential",
        train_schedule=schedule, cp_mode="ring", **chunks, **energy)
    return merak.MerakTrainer(model=model, args=args,
                              train_dataset=dataset(MICROBATCHES * LIMIT, SEED))


def _losses(trainer: merak.MerakTrainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _scenario(schedule: str, cp: int = 1) -> dict:
    """`schedule` on 4 / cp pipeline ranks, each stage on cp context-parallel ranks (a plan per
    pipeline rank, followed by its cp ranks): what the auto run did (its plans, events, phases
    and instructions, metrics and files) and its losses next to a run without clocks."""
    drift = DRIFT and schedule == "1f1b" and cp == 1
    stop = StopAfterThePlan(drift)
    run_name = schedule if cp == 1 else f"{schedule}-cp{cp}"
    auto_run = _trainer(f"auto-{run_name}", schedule, LIMIT, cp, energy_gpu="simulated",
                        simulated_gpu=SIMULATED, energy_mode="auto",
                        energy_replan_margin=0.5 if drift else 1.0)
    stop.trainer = auto_run
    auto_run.add_callback(stop)
    output = auto_run.train()
    auto, energy = auto_run.energy.auto, auto_run.energy
    steps = auto_run.state.global_step
    deployed = [p["step"] for p in auto.plans]
    # which steps ran this rank's plan, and how many of its instructions each consumed (the
    # hook checks the names and the count: a mismatch raises)
    phases = energy.phases
    expected = expected_instructions(auto_run.engine.interpreter.schedule, auto_run.ctx.pp_rank)
    consumed = dict(zip(range(1, steps + 1), energy.hook.consumed))
    figures = {
        "drift": drift, "steps": steps, "limit": LIMIT, "plans": len(auto.plans),
        "events": [list(e) for e in auto.events],
        "same_plan_steps_on_every_rank": all(mine == deployed
                                             for mine in all_gather_objects(deployed)),
        "profile_steps": auto.profile_steps, "rounds": auto.rounds,
        "profile_clocks": PROFILE_CLOCKS,
        "planned_consumed": [consumed[s] for s in range(1, steps + 1) if phases[s] == "plan"],
        "plan_instructions": len(expected),
        "profile_phase_steps": Counter(phases.values())["profile"],
        "metrics": sorted(output.metrics)}
    if dist.get_rank() == 0:
        files = out_dir() / f"auto-{run_name}"
        figures["missing_files"] = [
            name for name in ("energy_steps.csv", "energy_steps.png", "energy/profile-1.csv",
                              "energy/plan-1.json", "energy/plan-1.png", "energy/plan-1.log")
            if not (files / name).exists()]
    if not auto.plans:  # (the figures say so)
        return figures

    plain = _trainer(f"plain-{run_name}", schedule, steps, cp)
    plain.train()
    compared, theirs = Compared(), _losses(plain)
    for step, loss in _losses(auto_run).items():  # clocks never change the numbers
        compared.value(f"step {step} loss", loss, theirs[step])

    plan = auto.plans[-1]
    REPORT[run_name] = {key: output.metrics[key] for key in (
        "energy_saved", "energy_step_time_change", "energy_predicted_saved",
        "energy_predicted_time_change", "energy_profile_steps", "energy_plan_step")}
    REPORT[run_name].update(steps=steps, replans=len(auto.plans) - 1,
                            all_max_steps=plan["all_max_steps"][1] - plan["all_max_steps"][0] + 1)
    if dist.get_rank() == 0:
        (out_dir() / "energy_auto_report.json").write_text(json.dumps(REPORT, indent=1))
    return compared.figures(**figures)


def table(report: dict[str, dict]) -> str:
    lines = [f"{'schedule':18}{'steps':>6}{'profile':>8}{'all-max':>8}{'plan at':>8}"
             f"{'predicted':>10}{'measured':>10}{'ratio':>7}{'time':>8}{'re-plans':>9}"]
    for name, r in report.items():
        ratio = r["energy_saved"] / r["energy_predicted_saved"] \
            if r["energy_predicted_saved"] else float("nan")
        lines.append(f"{name:18}{r['steps']:6d}{r['energy_profile_steps']:8d}"
                     f"{r['all_max_steps']:8d}{r['energy_plan_step']:8d}"
                     f"{r['energy_predicted_saved']:10.2%}{r['energy_saved']:10.2%}{ratio:7.2f}"
                     f"{r['energy_step_time_change']:+8.2%}{r['replans']:9d}")
    return "\n".join(lines)


def summary() -> None:
    if dist.get_rank() == 0 and REPORT:
        print("energy auto (measured saving of the last plan against the all-max steps before "
              "it; ratio: measured / predicted)\n" + table(REPORT), flush=True)


SCENARIOS = {f"energy-auto-{name}": (lambda name=name: _scenario(name))
             for name in SCHEDULE_NAMES}
# pipeline ranks are global ranks // (dp x cp x tp): 2 stages of 2 cp ranks each
SCENARIOS["energy-auto-1f1b-cp2"] = lambda: _scenario("1f1b", cp=2)
SCENARIOS["energy-auto-summary"] = summary


def scenarios(world_size: int) -> dict:
    assert world_size == RANKS, f"energy_auto runs on {RANKS} ranks, not {world_size}"
    return SCENARIOS


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
