"""``energy_mode="auto"``: profile, plan and deploy a clock plan inside the training run.

Every rank goes through the same phases at the same steps (each change is decided by a
collective at a step boundary, over the gloo host group, `ParallelContext.host_group`):

1. **profile**: training steps (real ones: the model keeps learning) with the clock profiler
   among the interpreter's hooks: a warm-up step, then one step per clock of `PROFILE_CLOCKS`
   spread over the GPU's range, highest first, stopping early once every rank's instruction
   energy has risen for `PATIENCE` clocks in a row. At most ``1 + PROFILE_CLOCKS`` steps.
2. **planning**: rank 0 writes the gathered profile and the interpreter's schedule (its programs
   as JSON) and starts ``python -m merak.energy plan`` on them in a background process (at a
   lower priority), at `energy_max_slowdown`; training goes on at maximum clocks. After every
   step all ranks all-reduce rank 0's flag "the planner has exited" (a host-side collective of
   one integer; nothing waits for the planner). Once it has, rank 0 broadcasts the plan, every
   rank checks it against the job (`check_clock_plan`, as any plan) and, if every rank accepts
   it, all follow it after `BASELINE_STEPS` more steps at maximum clocks (the all-max reference
   the plan is measured against, with the planner no longer competing for the host's cores). A
   planner that fails leaves the run at maximum clocks.
3. **planned**: `ClockPlanHook` sets each instruction's clock. Every `DRIFT_WINDOW` steps the
   slowest rank's median step time is compared with the plan's predicted time (scaled by the
   measured over the predicted all-max time); past ``energy_replan_margin`` the run re-profiles
   and re-plans (phase 1; at most `MAX_REPLANS` times).

Files go to ``output_dir/energy/``: ``profile-N.csv``, ``schedule-N.json``, ``plan-N.json``,
its frontier picture ``plan-N.png`` and the planner's output ``plan-N.log`` for the N-th round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from merak.distributed.host_objects import all_gather_objects, broadcast_object
from merak.energy.planning.plan_file import ClockPlanError, load_clock_plan
from merak.energy.profiling.profile_data import write_profile
from merak.energy.profiling.profiler import ClockProfiler
from merak.energy.training.deploy import ClockPlanHook
from merak.runtime.hooks import InstructionHook
from merak.schedule.actions import Action

PROFILE_CLOCKS = 8  # clocks profiled, spread over the GPU's range
WARMUP_STEPS = 1
PATIENCE = 2        # clocks of rising energy that end profiling
BASELINE_STEPS = 5  # all-max steps measured once the plan is ready, before it is deployed
DRIFT_WINDOW = 5    # planned steps per drift check
MAX_REPLANS = 2
def spread_clocks(supported: list[int], count: int = PROFILE_CLOCKS) -> list[int]:
    """`count` of the `supported` clocks, evenly spread from the highest to the lowest."""
    clocks = sorted(supported, reverse=True)
    if len(clocks) <= count:
        return clocks
    return [clocks[i] for i in sorted({round(k * (len(clocks) - 1) / (count - 1))
                                       for k in range(count)})]


class AutoHook(InstructionHook):
    """The one energy hook of an auto run: `meter` (a `ClockPlanHook`) measures every step and
    follows the plan once there is one; while `profiler` is set it times the instructions at
    the step's clock instead."""

    def __init__(self, meter: ClockPlanHook):
        self.meter = meter
        self.profiler: ClockProfiler | None = None

    def on_step_begin(self, step: int) -> None:
        self.meter.on_step_begin(step)
        if self.profiler is not None:
            self.profiler.on_step_begin(step)

    def on_instruction_begin(self, name: str, action: Action) -> None:
        (self.profiler or self.meter).on_instruction_begin(name, action)

    def on_instruction_end(self, name: str, action: Action) -> None:
        (self.profiler or self.meter).on_instruction_end(name, action)

    def on_step_end(self, step: int) -> None:
        self.meter.on_step_end(step)


class AutoEnergy:
    """The phases of ``energy_mode="auto"`` (see the module docstring) for `session` (a
    `merak.energy.training.session.TrainerEnergy`); every rank calls `before_step` and `after_step`
    around each training step."""

    def __init__(self, session):
        self.session, self.ctx, self.gpu = session, session.ctx, session.gpu
        args = session.args
        self.max_slowdown, self.margin = args.energy_max_slowdown, args.energy_replan_margin
        self.directory = Path(args.output_dir) / "energy"
        self.clocks = spread_clocks(self.gpu.supported_clocks())
        self.hook = AutoHook(session.hook)
        self.rounds = 0
        self.profile_steps = 0
        self.plans: list[dict] = []                # deployed: step, path, predicted, ...
        self.events: list[tuple[int, str]] = []    # (first step, what changed)
        self._process: subprocess.Popen | None = None
        self._begin_profile(1)

    # ------------------------------------------------------------------ collectives
    def _reduce(self, value: float, op, dtype=torch.int64) -> float:
        """`value` reduced over every rank, on the host (gloo) group."""
        if self.ctx.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=dtype)
        dist.all_reduce(tensor, op=op, group=self.ctx.host_group())
        return tensor.item()

    def _say(self, text: str) -> None:
        if self.ctx.rank == 0:
            print(f"energy auto: {text}", flush=True)

    # ------------------------------------------------------------------ phases
    def label(self) -> str:
        """The clocks of the step about to run: profile, all-max or plan."""
        if self.phase == "profile":
            return "profile"
        return "plan" if self.phase == "planned" else "all-max"

    def before_step(self, step: int) -> None:
        if self.phase == "profile":
            self.profiler.clock = self._queue[0]

    def after_step(self, step: int) -> None:
        if self.phase == "profile":
            self._profiled(step)
        elif self.phase == "planning":
            self._poll(step)
        elif self.phase == "baseline":
            self._baseline(step)
        elif self.phase == "planned":
            self._watch(step)

    def _begin_profile(self, step: int) -> None:
        self.rounds += 1
        self.phase, self._began = "profile", step
        self.profiler = self.hook.profiler = ClockProfiler(self.gpu, self.ctx.pp_rank)
        self.session.hook.frequencies = None
        self.gpu.reset_clock()
        self._queue = [None] * WARMUP_STEPS + list(self.clocks)
        self._rising, self._previous = 0, None

    def _profiled(self, step: int) -> None:
        clock = self._queue.pop(0)
        self.profile_steps += 1
        if clock is not None:
            energy = self.profiler.mean_energy(clock)
            rising = self._previous is not None and energy > self._previous
            self._rising, self._previous = self._rising + 1 if rising else 0, energy
        if self._reduce(int(not self._queue or self._rising >= PATIENCE), dist.ReduceOp.MIN):
            self._plan_in_background(step)

    def _plan_in_background(self, step: int) -> None:
        self.hook.profiler = None
        self.gpu.reset_clock()
        ctx = self.ctx
        rows = self.profiler.rows(ctx.rank, ctx.dp_rank, ctx.pp_rank, ctx.tp_rank)
        if ctx.world_size > 1:
            rows = [row for part in all_gather_objects(rows, ctx.host_group()) for row in part]
        clocks = len({r.frequency for r in rows if r.instruction != "p2p"})
        self.phase, self._planning = "planning", step
        self._path = self.directory / f"plan-{self.rounds}.json"
        if ctx.rank != 0:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        profile = write_profile(rows, self.directory / f"profile-{self.rounds}.csv")
        programs = self.directory / f"schedule-{self.rounds}.json"  # the interpreter's own
        programs.write_text(json.dumps(self.session.schedule.to_json()))
        arguments = [str(profile), "--programs", str(programs), "--max-slowdown",
                     str(self.max_slowdown), "--out", str(self._path)]
        # this merak first on the path, whatever the working directory (a fresh interpreter
        # importing merak.energy alone: it starts in about a second, beside the training ranks)
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        with self._path.with_suffix(".log").open("w") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "merak.energy", "plan", *arguments],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        if hasattr(os, "setpriority"):  # the training processes come first
            try:
                os.setpriority(os.PRIO_PROCESS, self._process.pid, 10)
            except OSError:
                pass
        self._say(f"profiled {clocks} clocks in {step - self._began + 1} training steps (steps "
                  f"{self._began}-{step}); planning in the background while training goes on "
                  f"at max clocks: python -m merak.energy plan {' '.join(arguments)}")

    def _poll(self, step: int) -> None:
        """The planner's result, once rank 0 sees it has exited (checked after every step)."""
        done = int(self.ctx.rank == 0 and self._process.poll() is not None)
        if not self._reduce(done, dist.ReduceOp.MAX):
            return
        body = None
        if self.ctx.rank == 0:
            code, self._process = self._process.returncode, None
            log = self._path.with_suffix(".log")
            try:
                body = load_clock_plan(self._path) if code == 0 else \
                    {"error": f"the planner exited with {code} (see {log})"}
            except ClockPlanError as error:
                body = {"error": str(error)}
        if self.ctx.world_size > 1:
            body = broadcast_object(body, 0, self.ctx.host_group())
        if "error" in body:
            return self._fail(step, body["error"])
        try:
            mine, refusal = self.session._check(body["schedules"]), None
        except ClockPlanError as error:
            mine, refusal = None, str(error)
        if refusal is not None:
            print(f"energy auto: rank {self.ctx.rank} refuses the plan: {refusal}", flush=True)
        if not self._reduce(int(refusal is None), dist.ReduceOp.MIN):
            return self._fail(step, "a rank refused the plan")
        self.phase, self._pending, self._base = "baseline", (mine, body), []
        self._say(f"plan {self._path} ready after {step - self._planning} steps at max clocks; "
                  f"{BASELINE_STEPS} more measure the all-max step it is compared with")

    def _baseline(self, step: int) -> None:
        """All-max steps with the planner gone (it shares the host's cores), then the plan."""
        self._base.append(self.session.hook.steps[-1].time_s)
        if len(self._base) < BASELINE_STEPS:
            return
        base = self._reduce(statistics.median(self._base), dist.ReduceOp.MAX, torch.float64)
        (mine, body), self._pending = self._pending, None
        self.session.hook.frequencies = mine
        self.phase, self._window = "planned", []
        plan = {"step": step + 1, "path": str(self._path), "predicted": body["predicted"],
                "baseline": body["baseline"], "measured_base_s": base,
                "all_max_steps": (step - BASELINE_STEPS + 1, step)}
        self.plans.append(plan)
        self.events.append((step + 1, f"plan {self.rounds} deployed"))
        saved = 1 - plan["predicted"]["energy_j"] / plan["baseline"]["energy_j"]
        slower = plan["predicted"]["time_s"] / plan["baseline"]["time_s"] - 1
        self._say(f"plan {self._path} deployed from step {step + 1} on every rank: predicted "
                  f"{saved:.2%} energy saved per step at {slower:+.2%} time (all-max step: "
                  f"median {base:.4f} s)")

    def _fail(self, step: int, reason: str) -> None:
        self.phase = "failed"
        self.events.append((step + 1, "planning failed"))
        self._say(f"no plan ({reason}); training goes on at max clocks")

    def _watch(self, step: int) -> None:
        """Re-plan when the step time drifts past the plan's prediction (see the module doc)."""
        self._window.append(self.session.hook.steps[-1].time_s)
        if len(self._window) < DRIFT_WINDOW:
            return
        measured = self._reduce(statistics.median(self._window), dist.ReduceOp.MAX,
                                torch.float64)
        self._window = []
        plan = self.plans[-1]
        expected = plan["predicted"]["time_s"] * plan["measured_base_s"] \
            / plan["baseline"]["time_s"]
        if measured > expected * (1 + self.margin) and self.rounds <= MAX_REPLANS:
            plan["until"] = step
            self.events.append((step + 1, "re-plan"))
            self._say(f"step time {measured:.4f} s drifted past the plan's {expected:.4f} s by "
                      f"more than {self.margin:.0%}: re-profiling from step {step + 1}")
            self._begin_profile(step + 1)

    def close(self) -> None:
        """Stop a planner still running (the run ended first)."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._process = None
