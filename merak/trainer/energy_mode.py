"""The trainer's energy modes (`MerakArguments.energy_*`): the session made at the build,
the profile mode's run, and the run's energy figures at the end of training."""

from __future__ import annotations

import time

from transformers.trainer_utils import TrainOutput

from merak.trainer.data import StageBatches


class EnergyMixin:
    """`MerakTrainer`'s energy parts: ``self.energy`` is the run's `TrainerEnergy` (None
    without ``energy_gpu``)."""

    energy = None

    def _start_energy(self) -> None:
        """The run's energy session (``energy_gpu`` set), made with the engine."""
        self.energy = None
        if self.args.energy_gpu:
            from merak.energy.training.session import TrainerEnergy

            self.energy = TrainerEnergy(self.args, self.ctx,
                                        self.args.gradient_accumulation_steps)

    def _energy_metrics(self, metrics: dict) -> None:
        """The energy figures of the run into the final `metrics` (and the steps' file and
        plot, on rank 0)."""
        self.energy.close()
        path = self.energy.write_steps(self.args.output_dir)
        figures = self.energy.metrics()
        metrics.update(figures)
        if path is None:
            return
        print(f"energy per step: {path} and {path.with_suffix('.png')} (compare runs with "
              f"`merak energy report`)")
        if "energy_saved" in figures:
            print(f"energy: {figures['energy_saved']:.2%} saved per step at "
                  f"{figures['energy_step_time_change']:+.2%} step time from step "
                  f"{figures['energy_plan_step']} (the plan predicted "
                  f"{figures['energy_predicted_saved']:.2%} at "
                  f"{figures['energy_predicted_time_change']:+.2%}), against the all-max steps "
                  f"of this run")

    def _profile_energy(self, data: StageBatches) -> TrainOutput:
        """Profile mode (`energy_profile`): training steps at each GPU clock, then the CSV."""
        m = self.args.gradient_accumulation_steps

        def batches():  # real training steps: with HF's token counts when the loss takes them
            for epoch in range(1_000_000):
                yield from (self._counted(batch, m, step=True) for batch in data.epoch(epoch))

        stream = batches()
        start = time.perf_counter()
        with self._running_loss():
            path, clocks = self.energy.profile(self.engine.interpreter, lambda: next(stream))
        self.energy.close()
        metrics = {"train_runtime": round(time.perf_counter() - start, 4),
                   "profiled_clocks": clocks}
        if self.is_world_process_zero():
            print(f"energy profile: {path} ({clocks} clocks); plan with "
                  f"`{self.energy.plan_command(path)}`")
        return TrainOutput(0, float("nan"), metrics)
