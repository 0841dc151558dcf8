"""Context parallelism: a micro-batch's sequence split over the cp ranks of a group, with the
load-balanced layout for causal attention (`split`), and attention across the split for any HF
family through transformers' attention-function registry (`attention`): Ulysses (all-to-all of
heads and sequence) or ring attention (`ring`). See docs/context-parallel.md."""

from merak.context_parallel.attention import (
    MODES,
    ContextParallelAttention,
    active_attention,
    disable_context_parallel,
    enable_context_parallel,
    unsupported_reason,
)
from merak.context_parallel.ring import ring_attention
from merak.context_parallel.split import (
    check_splittable,
    rank_positions,
    shift_labels,
    split_batch,
)

__all__ = [
    "MODES",
    "ContextParallelAttention",
    "active_attention",
    "check_splittable",
    "disable_context_parallel",
    "enable_context_parallel",
    "rank_positions",
    "ring_attention",
    "shift_labels",
    "split_batch",
    "unsupported_reason",
]
