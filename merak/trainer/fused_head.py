"""TRL's fused LM head (``add_fused_lm_head``; ``model(..., fused_lm_head=True)``) answered
from the last pipeline stage's logits.

TRL patches the model's forward so that, called with ``fused_lm_head=True``, it returns
per-token statistics of the next-token distribution instead of the logits (TRL's
``FusedCausalLMOutput``; its documented contract): each per-token field has the labels' shape
after the causal shift (``labels[:, 1:]``, or ``shift_labels`` as given) and is zero where the
label is -100; ``loss`` is the summed negative log-likelihood over ``num_items_in_batch`` (the
count of valid labels when not given, at least 1). Here the same fields are computed in float32
from the logits the last stage already holds (temperature 1, as TRL's ``SFTTrainer`` patches
it; any logit scaling or soft-capping the model applies is inside those logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput


@dataclass
class FusedHeadOutput(ModelOutput):
    """The fields of TRL's ``FusedCausalLMOutput``, read by attribute."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def fused_outputs(logits: torch.Tensor, labels: torch.Tensor | None,
                  shift_labels: torch.Tensor | None,
                  num_items_in_batch: torch.Tensor | int | None) -> FusedHeadOutput:
    """TRL's fused-head fields for `logits` (batch, seq, vocab) against the next-token labels."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("the fused LM head scores labels: call it with labels or "
                             "shift_labels")
        logits, targets = logits[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    targets = targets.to(logits.device)
    mask = targets != -100
    scores = logits.float()
    log_z = torch.logsumexp(scores, dim=-1)
    log_p = scores - log_z.unsqueeze(-1)
    target = scores.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_probs = (target - log_z).masked_fill(~mask, 0.0)
    entropy = -(log_p.exp() * log_p).sum(-1).masked_fill(~mask, 0.0)
    with torch.no_grad():
        log_sum_sq_probs = torch.logsumexp(2 * log_p, dim=-1).masked_fill(~mask, 0.0)
        mean_logits = scores.mean(-1).masked_fill(~mask, 0.0)
        is_top1 = (scores.argmax(-1) == targets) & mask
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / count
    return FusedHeadOutput(loss=loss, log_probs=log_probs, entropy=entropy,
                           log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits,
                           is_top1=is_top1, label_mask=mask)
