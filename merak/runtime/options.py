"""`RuntimeOptions`: how the `PipelineInterpreter` runs a training step."""

from __future__ import annotations

from dataclasses import dataclass

from merak.schedule.actions import Schedule
from merak.schedule.registry import schedule_info


@dataclass(frozen=True)
class RuntimeOptions:
    """The pipeline runtime's options: the schedule, the micro-batches, gradient reduction over
    dp, recomputation and the activations' memory.

    schedule: a name in `merak.schedule.registry.SCHEDULES` or an explicit `Schedule`.
    num_microbatches: micro-batches per step (gradient accumulation steps).
    num_model_chunks: model chunks per rank for interleaved 1F1B (the stage's build reads it;
        ``zbv`` and ``dualpipev`` hold 2 whatever it says: `chunks`).
    bucket_bytes: dp all-reduce bucket size.
    grad_predivide: dp gradients are divided by this before the all-reduce, the rest after.
    recompute_ratio: fraction of each stage's blocks whose activations are recomputed (one
        value per stage of the split, or one for all); the schedule gets `recompute` actions
        for the stages that recompute any.
    segment_size: consecutive blocks per recomputed segment (only the segment's input is kept;
        ``checkpoint_num_layers``).
    recompute_in_backward: recomputed blocks rerun one at a time inside the backward
        (`BlockRecomputation`'s ``in_backward``), not all in the ``recompute`` action.
    dealloc_outputs: free each sent activation's data once its sends ended, keeping its
        autograd graph for the backward (`PipelineStage.freeable_outputs` says which).
    measure_activations: count the activation bytes each stage keeps for backward;
        ``activation_peak`` then holds the last step's peak over this rank's stages.
    lend_idle_cores: on CPU with every rank on one host, give compute actions that the
        schedule runs alone the cores of the ranks idling meanwhile (`IdleCoreLending`).
    """

    schedule: str | Schedule = "1f1b"
    num_microbatches: int = 1
    num_model_chunks: int = 1
    bucket_bytes: int = 25 * 2**20
    grad_predivide: float = 1.0
    recompute_ratio: float | tuple[float, ...] = 0.0
    segment_size: int = 1
    recompute_in_backward: bool = False
    dealloc_outputs: bool = False
    measure_activations: bool = False
    lend_idle_cores: bool = True

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.num_model_chunks < 1:
            raise ValueError(f"num_model_chunks must be >= 1, got {self.num_model_chunks}")
        if not isinstance(self.recompute_ratio, (int, float)):
            object.__setattr__(self, "recompute_ratio", tuple(self.recompute_ratio))

    @property
    def chunks(self) -> int:
        """Model chunks per rank: the schedule's (2 for ``zbv`` and ``dualpipev``;
        `num_model_chunks` for interleaved 1F1B; else 1; an explicit `Schedule`:
        `num_model_chunks`)."""
        if isinstance(self.schedule, Schedule):
            return self.num_model_chunks
        return schedule_info(self.schedule).stages_per_rank(self.num_model_chunks)
