"""HF Trainer's label smoothing (`label_smoothing_factor`) as a Merak loss function.

`LabelSmoothedLoss(epsilon)(outputs, labels)` equals transformers' `LabelSmoother` as HF
`Trainer.compute_loss` applies it: ``(1 - eps) * NLL + eps * mean_over_vocab(-log p)``, both
averaged over the tokens whose label is not -100 (or divided by ``num_items_in_batch``, HF's
token count of the step, when given), the labels shifted by one for causal LMs.
Given ``group`` (the TP group), the logits may be split along the vocabulary across it (Megatron's
vocab-parallel LM head without a gather): the log-softmax normalizer, the target log-probability
and the sum of log-probabilities over the vocabulary are then reduced across the group, as
`merak.vocab_parallel_cross_entropy` does for the plain loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
)

from merak.tensor_parallel.layers.collectives import reduce_from_tp


def shifts_labels(model) -> bool:
    """HF's rule: the labels are shifted when the model's class is a causal LM."""
    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def classifies_sequences(model) -> bool:
    """Whether `model` is an HF ``*ForSequenceClassification``: one row of ``num_labels``
    logits per sequence, pooled at its last non-pad token."""
    return type(model).__name__ in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values()


class LabelSmoothedLoss:
    def __init__(self, epsilon: float, shift_labels: bool = True, ignore_index: int = -100,
                 group=None):
        self.epsilon, self.shift_labels = epsilon, shift_labels
        self.ignore_index, self.group = ignore_index, group

    def __call__(self, outputs, labels: torch.Tensor,
                 num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else \
            getattr(outputs, "logits", outputs)
        if self.shift_labels:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        logits, labels = logits.float().flatten(0, -2), labels.flatten()
        group = self.group
        size = dist.get_world_size(group) if group is not None else 1
        local_vocab = logits.shape[-1]
        start = (dist.get_rank(group) if group is not None else 0) * local_vocab
        with torch.no_grad():
            peak = logits.max(dim=-1).values
            if size > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        log_normalizer = _sum(shifted.exp().sum(-1), group, size).log()
        owned = (labels >= start) & (labels < start + local_vocab)
        index = (labels - start).clamp(0, local_vocab - 1).unsqueeze(-1)
        target = _sum(shifted.gather(-1, index).squeeze(-1) * owned, group, size)
        nll = log_normalizer - target  # -log p(label)
        # sum over the vocabulary of -log p(v) = V * log Z - sum_v shifted_v
        vocab = local_vocab * size
        smoothed = vocab * log_normalizer - _sum(shifted.sum(-1), group, size)
        valid = labels != self.ignore_index
        # as LabelSmoother: HF's token count of the step when given, else this batch's (NaN
        # when no label is valid)
        count = valid.sum() if num_items_in_batch is None else num_items_in_batch
        nll = (nll * valid).sum() / count
        smoothed = (smoothed * valid).sum() / (count * vocab)
        return (1 - self.epsilon) * nll + self.epsilon * smoothed


def _sum(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    return reduce_from_tp(tensor, group) if size > 1 else tensor
