"""`TensorParallelOptions`: how `merak.apply_tensor_parallel` shards a model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from merak.tensor_parallel.plans.tp_plan import TPPlan


@dataclass(frozen=True)
class TensorParallelOptions:
    """Tensor parallelism's options.

    plan: the tensor-parallel plan (a `TPPlan`, or a dict of `merak.set_tp_layer_lists`'
        arguments); None: the one `set_tp_layer_lists` recorded for the job, else the model
        family's, else the config's ``base_model_tp_plan``.
    parallel_vocab: shard the embedding and LM head over the vocabulary (vocab-parallel loss).
    sequence_parallel, sequence_dim: keep the activations between blocks split along
        `sequence_dim` over the tp ranks (Megatron's sequence parallelism).
    overlap_level, overlap_sub_batches: sub-pipelined TP (``tp_overlapping_level``): 0 off, 1
        overlap the forward's all-reduces, 2 also the backward's, over `overlap_sub_batches`
        sub-batches.
    """

    plan: TPPlan | Mapping | None = None
    parallel_vocab: bool = False
    sequence_parallel: bool = False
    sequence_dim: int = 1
    overlap_level: int = 0
    overlap_sub_batches: int = 2
