"""The interpreter's forward-only walks: evaluation (`eval_step`) and the activation
measurement that stage-aware recomputation plans from (`measure_forward`). Mixed into
`PipelineInterpreter`, whose `_run` walks the programs `merak.runtime.program` makes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from merak.distributed import liveness
from merak.runtime.program import forward_program
from merak.schedule.actions import Action


class ForwardOnly:
    """Mixed into `PipelineInterpreter` (which provides ctx, split, runners, stage, segments,
    num_microbatches, stages_per_rank, placement, `_run` and `_install_recomputation`)."""

    def eval_step(self, batch: dict[str, torch.Tensor] | Sequence[dict] | None,
                  num_microbatches: int | None = None, keep: str | None = None) -> float:
        """Forward only, without gradients, in eval mode: the mean loss over `batch` (this dp
        rank's share) and the dp ranks, on every rank. Hooks are not called. With `keep`, the
        last stage also keeps that model output (e.g. ``"logits"``) of every micro-batch in
        ``self.kept``, concatenated along the batch dimension."""
        m = num_microbatches or self.num_microbatches
        program = self._forward_program(m)
        last = self.runners.get(self.split.num_stages - 1)
        if last is not None:
            last.keep = keep
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad(), liveness.waiting("a forward-only (evaluation) step"):
                loss = self._run(program, batch, m, hooks=())
            self.kept = torch.cat(last.kept) if last is not None and last.kept else None
            return loss
        finally:
            self.stage.train(was_training)
            if last is not None:
                last.keep, last.kept = None, []

    def measure_forward(self, batch: dict[str, torch.Tensor] | None,
                        segments: dict[int, Sequence[Sequence[int]]]) -> dict[int, int]:
        """Activation bytes micro-batch 0's forward keeps on each local stage for backward when
        it recomputes the blocks of `segments` (per local stage); a collective (every rank calls
        it: the micro-batch moves through the pipeline). Draws random numbers as a forward
        does."""
        self._install_recomputation(segments, measure="stage")
        try:
            with liveness.waiting("the activation measurement (recomputation planning)"):
                self._run(self._forward_program(1), batch, self.num_microbatches, hooks=(),
                          microbatches_used=1)
            return {s: r.meter.peak for s, r in self.runners.items()}
        finally:
            self._install_recomputation({s: self.segments[s] for s in self.runners})

    def _forward_program(self, num_microbatches: int) -> list[Action]:
        return forward_program(self.split, self.ctx.pp, self.ctx.pp_rank, self.stages_per_rank,
                               num_microbatches, placement=self.placement)
