"""What `MerakTrainer` wraps around the user's model: the loss function."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from merak.trainer.token_counts import ITEMS


def default_loss_fn(outputs, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of next-token logits against labels (HF's causal-LM shift, -100 ignored)."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits[..., :-1, :].flatten(0, -2).float(),
                           labels[..., 1:].flatten(), ignore_index=-100)


class _WithLoss(nn.Module):
    """Model + `loss_fn` as one module, so the split's last stage returns the loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        # the model's config, so tensor parallelism finds the family's plan (its module
        # patterns match the wrapped names, "model." + the model's own, by suffix)
        self.config = getattr(model, "config", None)
        self.no_cache = "use_cache" in inspect.signature(model.forward).parameters

    def forward(self, labels: torch.Tensor | None = None, **inputs):
        if self.no_cache:  # a KV cache cannot be traced (and is useless in training)
            inputs.setdefault("use_cache", False)
        count = inputs.pop(ITEMS, None)  # HF's token count, for the loss alone
        extra = {ITEMS: count} if count is not None else {}
        return self.loss_fn(self.model(**inputs), labels, **extra)


def with_loss(model: nn.Module, loss_fn: Callable, input_names: Sequence[str]) -> _WithLoss:
    """`_WithLoss` whose forward names its inputs (torch.export binds keyword inputs by the
    signature and cannot take them through ``**inputs``)."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
        for n in ("labels", *[n for n in input_names if n != "labels"])]

    def forward(self, **kwargs):
        return _WithLoss.forward(self, **kwargs)

    forward.__signature__ = inspect.Signature(params)
    cls = type("WithLoss", (_WithLoss,), {"forward": forward})
    return cls(model, loss_fn)
