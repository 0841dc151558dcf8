"""Energy in `MerakTrainer`: measure every step, profile clocks, or train under a clock plan.

`TrainerEnergy` is built from `MerakArguments` (`energy_gpu`, `simulated_gpu`,
`energy_profile`, `energy_plan`, `pfo_server_url`) before the interpreter, and `attach`ed to it
once its schedule is final (after the recomputation planning), before the first step:

- always: one `ClockPlanHook` per rank measures each step's time and GPU energy (without a plan
  it changes no clock: the measured run is the unmodified one, the baseline); the trainer
  logs their means and rank 0 writes ``output_dir/energy_steps.csv`` (iteration time: the
  slowest rank; energy: every GPU), which `merak energy report` compares with a baseline;
- `energy_profile`: `profile()` runs the clock profiler over training steps and writes its CSV;
- `energy_plan` / `pfo_server_url`: the hook follows the plan, checked against the programs the
  interpreter runs (``engine.schedule``: any registered schedule, recomputation, split backward
  and model chunks included) before the first step; with a Perseus server each window of logged
  steps is reported back and the next schedule fetched (a Zeus server may hand out a new one);
- ``energy_mode="auto"``: `merak.energy.training.auto.AutoEnergy` profiles, plans in the background
  and deploys within the run (its `AutoHook` is the interpreter's energy hook: `engine_hook`).

Rank 0 also draws the steps (``energy_steps.png``) and `metrics` gives the run's figures for the
trainer's final metrics (with a plan: the saving, measured against the all-max steps of the same
run in auto mode, as predicted by the plan file otherwise).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from merak.energy.planning.plan_file import check_clock_plan, load_clock_plan
from merak.energy.profiling.gpu import (
    NVMLGPU,
    GPUControl,
    SimulatedGPU,
    SyntheticGPUModel,
    nvml_uuid,
)
from merak.energy.training.deploy import ClockPlanHook
from merak.schedule.actions import ActionKind, Schedule
from merak.schedule.reference import runs_reference
from merak.schedule.registry import SCHEDULES, make_schedule

STEPS_FILE = "energy_steps.csv"


def make_gpu(kind: str, simulated: str | None, num_ranks: int, chunks: int = 1,
             control: bool = True) -> GPUControl:
    """The `energy_gpu` backend of this rank (`num_ranks` pipeline ranks, `chunks` model chunks
    per rank: the simulated GPU's instruction times). Without `control` (measuring only) NVML
    is not probed for clock locking, which needs root and changes the clock for a moment."""
    if kind == "nvml":
        if not torch.cuda.is_available():
            raise RuntimeError("energy_gpu='nvml' needs a CUDA GPU; on a CPU machine use "
                               "energy_gpu='simulated'")
        return NVMLGPU(nvml_uuid(torch.cuda.current_device()), control=control)
    overrides = {}
    if simulated:
        try:
            overrides = json.loads(simulated)
        except json.JSONDecodeError as error:
            raise ValueError(f"simulated_gpu is not JSON ({error}): {simulated!r}") from None
        known = {f.name for f in dataclasses.fields(SyntheticGPUModel)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"simulated_gpu sets unknown fields {unknown}; the model has "
                             f"{sorted(known)}")
    return SimulatedGPU(SyntheticGPUModel(**overrides), num_ranks=num_ranks, chunks=chunks)


def plan_arguments(schedule: Schedule) -> list[str]:
    """The `merak energy plan` options that rebuild `schedule`'s programs (with chain edges):
    ``--schedule``, ``--stages``, ``--microbatches``, ``--interleave``, ``--reference`` and
    ``--recompute`` (bare when every stage recomputes, else one 0/1 flag per stage)."""
    args = ["--schedule", schedule.name, "--stages", str(schedule.num_ranks),
            "--microbatches", str(schedule.num_microbatches)]
    if schedule.stages_per_rank > 1:
        args += ["--interleave", str(schedule.stages_per_rank)]
    # a reference model's forward in every step (merak.schedule.reference)
    reference = runs_reference(schedule)
    if reference:
        args += ["--reference", "per_step"]
    flags = [any(a.kind is ActionKind.RECOMPUTE for a in schedule.stage_actions(s))
             for s in range(schedule.num_stages)]
    if any(flags):
        every = make_schedule(schedule.name, schedule.num_ranks, schedule.num_microbatches,
                              stages_per_rank=schedule.stages_per_rank, recompute=True,
                              reference=reference)
        same = [every.compute_actions(r) == schedule.compute_actions(r)
                for r in range(schedule.num_ranks)]
        args += ["--recompute"] if all(same) else \
            ["--recompute", ",".join(str(int(f)) for f in flags)]
    return args


class TrainerEnergy:
    """The trainer's energy side (see the module docstring): build it with the arguments, put
    `hook` among the interpreter's hooks (not in profile mode), then `attach(engine)`."""

    def __init__(self, args, ctx, num_microbatches: int | None = None):
        self.args, self.ctx = args, ctx
        info = SCHEDULES[args.train_schedule]
        chunks = info.stages_per_rank(args.num_model_chunks)
        # clocks change only to profile them or to follow a plan; else measuring changes none
        self.controls = bool(args.energy_profile or args.energy_plan or args.pfo_server_url
                             or args.energy_mode)
        self.gpu = make_gpu(args.energy_gpu, args.simulated_gpu, ctx.pp, chunks, self.controls)
        self.schedule: Schedule | None = None  # the interpreter's, from `attach`
        self.source = "all-max"
        self.client = self.job_id = None
        self._plan: list[dict] | None = None
        self.plan_file: dict | None = None
        if args.energy_plan:
            self.plan_file = load_clock_plan(args.energy_plan)  # unreadable: fail early
            self._plan = self.plan_file["schedules"]
            self.source = args.energy_plan
        elif args.pfo_server_url:
            from merak.energy.service.pfo_client import PFOClient, join_job

            self.client = PFOClient(args.pfo_server_url)
            self.job_id = join_job(self.client, ctx, self.gpu.supported_clocks(),
                                   metadata=Path(args.output_dir).name)
            self.source = f"{args.pfo_server_url} job {self.job_id}"
        self.hook = ClockPlanHook(self.gpu, None, ctx.pp_rank)
        self.auto = None
        if args.energy_mode == "auto":
            from merak.energy.training.auto import AutoEnergy

            self.auto = AutoEnergy(self)
        self.engine_hook = self.auto.hook if self.auto is not None else self.hook
        self.steps: list[tuple[int, float, float]] = []  # (step, time of the slowest, all GPUs)
        self.phases: dict[int, str] = {}  # step -> profile, all-max or plan
        self._window: list[tuple[int, float, float]] = []  # this rank's own, not yet gathered

    def attach(self, engine) -> None:
        """Take the interpreter's schedule (``engine.schedule``, final: after any recomputation
        planning) and check the plan against it; every rank calls it before the first step
        (with a Perseus server it is a collective)."""
        self.schedule = engine.schedule
        if self._plan is not None:
            self.hook.frequencies = self._check(self._plan)
        elif self.client is not None:
            self.hook.frequencies = self._fetch()

    def _check(self, schedules: list[dict]) -> list[tuple[str, int]]:
        ranks_per_stage = self.ctx.world_size // self.ctx.pp  # dp x cp x tp
        by_rank = check_clock_plan(schedules, self.ctx.world_size, lambda r: r // ranks_per_stage,
                                   self.schedule, self.gpu.supported_clocks())
        return by_rank[self.ctx.rank]

    def _fetch(self) -> list[tuple[str, int]]:
        from merak.energy.service.pfo_client import fetch_schedules

        return self._check(fetch_schedules(self.client, self.job_id, self.ctx))

    # ---------------------------------------------------------------- profile mode
    def profile(self, engine, next_batch: Callable[[], dict]) -> tuple[Path, int]:
        """Profile every clock over training steps; rank 0 writes `energy_profile`. Returns the
        CSV path and the number of clocks profiled."""
        from merak.energy.profiling.profile_data import write_profile
        from merak.energy.profiling.profiler import ClockProfiler, profile_clocks

        self.schedule = engine.schedule
        profiler = ClockProfiler(self.gpu, self.ctx.pp_rank)
        engine.hooks.append(profiler)
        try:
            rows = profile_clocks(lambda: engine.train_step(next_batch()), profiler, self.ctx)
        finally:
            engine.hooks.remove(profiler)
        path = Path(self.args.energy_profile)
        if self.ctx.rank == 0:
            write_profile(rows, path)
        return path, len({r.frequency for r in rows if r.instruction == "forward"})

    def plan_command(self, profile: str | Path) -> str:
        """The `merak energy plan` command for `profile` that plans this job's schedule."""
        return " ".join(["merak energy plan", str(profile), *plan_arguments(self.schedule)])

    # ---------------------------------------------------------------- training
    def step_begin(self, step: int) -> None:
        """Before training step `step` (auto mode: the profiler's clock for it)."""
        if self.auto is not None:
            self.auto.before_step(step)

    def step_done(self, step: int) -> None:
        """Keep the step the hook just measured (this rank's own, until the next gather); in
        auto mode, the collectives that move the run between phases (every rank, every
        step)."""
        if self.schedule is None:
            raise RuntimeError("TrainerEnergy.attach(engine) must run before the first step "
                               "(it checks the clock plan against the interpreter's schedule)")
        mine = self.hook.steps[-1]
        self._window.append((step, mine.time_s, mine.energy_j))
        self.phases[step] = self.auto.label() if self.auto is not None else \
            "all-max" if self.hook.frequencies is None else "plan"
        if self.auto is not None:
            self.auto.after_step(step)

    def _gather(self) -> list[tuple[int, float, float]]:
        """Every rank's steps since the last gather, combined into `self.steps` (a collective:
        every rank calls it, at the same step); returns this rank's own."""
        own, self._window = self._window, []
        if not own:
            return own
        device = self.ctx.device  # NCCL gathers GPU tensors
        mine = torch.tensor([[t, e] for _, t, e in own], dtype=torch.float64, device=device)
        parts = [torch.zeros_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(parts, mine)
        every = torch.stack(parts).cpu()  # rank x step x (time, energy)
        slowest, total = every[..., 0].amax(dim=0), every[..., 1].sum(dim=0)
        self.steps += [(step, t.item(), e.item()) for (step, _, _), t, e in
                       zip(own, slowest, total)]
        return own

    def log_window(self) -> dict[str, float]:
        """Means over the steps since the last log; reports them to the Perseus server."""
        own = self._gather()
        if not own:
            return {}
        recent = self.steps[-len(own):]
        logs = {"step_time_s": round(sum(t for _, t, _ in recent) / len(own), 4),
                "step_energy_j": round(sum(e for _, _, e in recent) / len(own), 2)}
        if self.client is not None:
            from merak.energy.service.pfo_client import PFOError, ProfilingResult

            try:
                self.client.report(self.job_id, ProfilingResult(
                    rank=self.ctx.rank, iter_time=[t for _, t, _ in own],
                    iter_energy=[e for _, _, e in own]))
            except PFOError as error:  # a lost report costs no training; say so and go on
                print(f"rank {self.ctx.rank}: {error}")
            self.hook.frequencies = self._fetch()
        return logs

    def write_steps(self, output_dir: str) -> Path | None:
        """Rank 0 writes every measured step as ``output_dir/energy_steps.csv`` and draws them
        as ``energy_steps.png`` (a collective: the steps since the last log are gathered
        first)."""
        from merak.energy.reporting.figures import save_steps_png

        self._gather()
        if self.ctx.rank != 0:
            return None
        path = Path(output_dir) / STEPS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "time_s", "energy_j", "phase", "clocks"])
            for step, time_s, energy_j in self.steps:
                writer.writerow([step, f"{time_s:.6f}", f"{energy_j:.4f}", self.phases[step],
                                 self._clocks_of(step)])
        if self.steps:
            figures = self.metrics()
            title = "energy and time per step" + (
                f"\nthe plan: {figures['energy_saved']:.2%} energy saved at "
                f"{figures['energy_step_time_change']:+.2%} time (medians, against the all-max "
                f"steps before it)" if "energy_saved" in figures else "")
            save_steps_png([(s, t, e, self.phases[s]) for s, t, e in self.steps],
                           path.with_suffix(".png"), self.auto.events if self.auto else (),
                           title)
        return path

    def _clocks_of(self, step: int) -> str:
        if self.auto is None:
            return self.source
        plan = next((p for p in reversed(self.auto.plans) if p["step"] <= step), None)
        return plan["path"] if self.phases[step] == "plan" else self.phases[step]

    def metrics(self) -> dict[str, float]:
        """The run's energy figures for the trainer's final metrics, from the gathered steps
        (after `write_steps`): medians of energy and time per step; with a plan, the energy
        saved and the step time change of the last plan, measured against the all-max steps
        of this run that preceded it (auto mode) and as predicted."""
        if not self.steps:
            return {}
        median = lambda values: statistics.median(values) if values else float("nan")
        figures = {"energy_per_step_j": round(median([e for _, _, e in self.steps]), 4),
                   "step_time_s": round(median([t for _, t, _ in self.steps]), 6)}
        predicted = self.plan_file
        if self.auto is not None:
            figures["energy_profile_steps"] = self.auto.profile_steps
            if self.auto.plans:
                plan = predicted = self.auto.plans[-1]
                first, last = plan["all_max_steps"]
                until = plan.get("until", self.steps[-1][0])
                base = [(t, e) for s, t, e in self.steps if first <= s <= last]
                after = [(t, e) for s, t, e in self.steps if plan["step"] <= s <= until]
                if base and after:
                    figures["energy_plan_step"] = plan["step"]
                    figures["energy_saved"] = round(
                        1 - median([e for _, e in after]) / median([e for _, e in base]), 6)
                    figures["energy_step_time_change"] = round(
                        median([t for t, _ in after]) / median([t for t, _ in base]) - 1, 6)
        if predicted is not None and "baseline" in predicted:
            figures["energy_predicted_saved"] = round(
                1 - predicted["predicted"]["energy_j"] / predicted["baseline"]["energy_j"], 6)
            figures["energy_predicted_time_change"] = round(
                predicted["predicted"]["time_s"] / predicted["baseline"]["time_s"] - 1, 6)
        return figures

    def close(self) -> None:
        if self.auto is not None:
            self.auto.close()
        if self.controls:
            self.gpu.reset_clock()
