"""The ``model`` a Trainer subclass's ``compute_loss(model, inputs, ...)`` gets on the last
pipeline stage: `StageModel`, built from that stage's logits for one micro-batch.

On a pipeline no rank holds the whole model, and the forward of the micro-batch has already run
through the stages when ``compute_loss`` is called. `StageModel` answers the calls HF's and
TRL's ``compute_loss`` make, as the whole HF causal LM would for that micro-batch:

- ``model(**inputs)`` (with or without ``labels``, ``num_items_in_batch``, ``shift_labels``):
  the model's output with ``logits`` and, given labels, the model's own loss
  (``model.loss_function``, HF's token-weighted one when given the count);
- ``model(**inputs, fused_lm_head=True)`` on a model whose forward TRL patched with its fused LM
  head (`merak.trainer.fused_head`);
- on a ``*ForSequenceClassification`` (TRL's reward models), ``model(**inputs)``: the pooled
  logits the last stage made (one row per sequence) and, given labels, HF's loss of them
  (``ForSequenceClassificationLoss``: its ``problem_type`` rules).

Any other call (other inputs than the micro-batch's, keywords that change what the forward
computes) would need the whole model again and cannot be answered from the last stage: it
raises `NotSupportedYetError` naming the keyword.
"""

from __future__ import annotations

import inspect

import torch
from transformers.loss.loss_utils import ForSequenceClassificationLoss
from transformers.modeling_outputs import CausalLMOutputWithPast, SequenceClassifierOutputWithPast

from merak.trainer.arguments import NotSupportedYetError
from merak.trainer.fused_head import fused_outputs
from merak.trainer.losses import classifies_sequences

# keywords of a call that select what the loss is computed against, not what the forward does
LOSS_KEYWORDS = ("labels", "shift_labels", "num_items_in_batch")
# keywords the stage's forward (traced in training mode, no cache, a ModelOutput) already honours
NEUTRAL = {"use_cache": (False, None), "return_dict": (True, None),
           "output_router_logits": (False, None)}
_WHY = ("on the last pipeline stage the model's outputs exist only for the micro-batch the "
        "pipeline ran (a loss needing the whole model on other inputs, or a second model, "
        "cannot run in a pipeline)")


def takes_fused_head(model) -> bool:
    """Whether `model`'s forward was patched by TRL's ``add_fused_lm_head``: it takes
    ``fused_lm_head`` (the patch shows the original signature through ``__wrapped__``)."""
    try:
        return "fused_lm_head" in inspect.signature(model.forward,
                                                    follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return False


class StageModel:
    """The whole model's outputs for one micro-batch, from the last stage's `logits`.

    Args:
        logits: the last stage's logits for the micro-batch (the full vocabulary).
        inputs: the micro-batch's model inputs as the stage ran them (labels included).
        user_model: the HF model the user gave (its ``loss_function`` and config).
        training: whether the stage is in training mode (``model.training``).
    """

    def __init__(self, logits: torch.Tensor, inputs: dict[str, torch.Tensor], user_model,
                 training: bool):
        self.logits, self.inputs, self.user_model = logits, inputs, user_model
        self.training = training
        self.config = getattr(user_model, "config", None)
        self.fused_head = takes_fused_head(user_model)
        self.classifier = classifies_sequences(user_model)

    def __call__(self, *args, fused_lm_head: bool = False, **kwargs):
        if args:
            raise NotSupportedYetError(f"compute_loss called the model with {len(args)} "
                                       f"positional arguments; pass the inputs by name")
        self._check(kwargs)
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        count = kwargs.get("num_items_in_batch")
        if fused_lm_head:
            if not self.fused_head:
                raise NotSupportedYetError("compute_loss called the model with fused_lm_head=True, "
                                           "but the model's forward takes no fused_lm_head (TRL's "
                                           "add_fused_lm_head did not patch it)")
            return fused_outputs(self.logits, labels, shift_labels, count)
        loss = None
        if self.classifier:  # the logits are the pooled ones: [rows, num_labels]
            if labels is not None:
                loss = ForSequenceClassificationLoss(labels, self.logits, self.config)
            return SequenceClassifierOutputWithPast(loss=loss, logits=self.logits)
        if labels is not None or shift_labels is not None:
            extra = {k: kwargs[k] for k in ("num_items_in_batch", "shift_labels") if k in kwargs}
            loss = self.user_model.loss_function(
                logits=self.logits, labels=labels,
                vocab_size=self.config.get_text_config().vocab_size, **extra)
        return CausalLMOutputWithPast(loss=loss, logits=self.logits)

    def answers(self, kwargs: dict) -> bool:
        """Whether a call with `kwargs` is one this micro-batch's outputs answer."""
        try:
            self._check({k: v for k, v in kwargs.items() if k != "fused_lm_head"})
        except NotSupportedYetError:
            return False
        return True

    def _check(self, kwargs: dict) -> None:
        for name, value in kwargs.items():
            if name in LOSS_KEYWORDS:
                continue
            if name in NEUTRAL:
                if value not in NEUTRAL[name]:
                    raise NotSupportedYetError(f"compute_loss called the model with "
                                               f"{name}={value!r}: {_WHY}")
                continue
            mine = self.inputs.get(name)
            same = mine is value or (torch.is_tensor(mine) and torch.is_tensor(value)
                                     and mine.shape == value.shape
                                     and torch.equal(mine, value.to(mine.device)))
            if not same:
                raise NotSupportedYetError(f"compute_loss called the model with {name!r} other "
                                           f"than the micro-batch's: {_WHY}")
        missing = [n for n in self.inputs if n not in kwargs and n not in LOSS_KEYWORDS]
        if missing:
            raise NotSupportedYetError(f"compute_loss called the model without {missing}, "
                                       f"which the micro-batch has: {_WHY}")

    # what compute_loss implementations read off the model besides calling it
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.user_model, name)
