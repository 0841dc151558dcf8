"""Which loss `MerakTrainer`'s last pipeline stage computes, and with which token counts.

Either traced into the last stage (the model's own loss, ``loss_fn``, HF's ``compute_loss_func``
or label smoothing), or, for a Trainer subclass that overrides ``compute_loss`` (TRL's
trainers, a project's own), that ``compute_loss`` run eagerly on the last stage from the traced
logits (`merak.trainer.subclass_loss`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from torch import nn

from merak.trainer.arguments import NotSupportedYetError
from merak.trainer.losses import LabelSmoothedLoss, classifies_sequences, shifts_labels
from merak.trainer.model_inputs import model_inputs
from merak.trainer.model_setup import default_loss_fn
from merak.trainer.subclass_loss import (
    SubclassLoss,
    scaled_for_accumulation,
    share_metrics,
    stage_logits,
)
from merak.trainer.subclasses import overrides
from merak.trainer.token_counts import ITEMS, takes_item_count, with_own_counts, with_step_count


@dataclass
class LossChoice:
    """The loss `MerakTrainer`'s last stage computes, chosen once when the trainer is made.

    fn: traced into the last stage's graph after the model (None: the model's own loss); the
        model is then wrapped with it, and its parameter names gain `name_prefix`.
    counts_items: HF's token-weighted loss (`merak.trainer.token_counts`).
    subclass: a Trainer subclass's ``compute_loss`` runs eagerly on the last stage from the
        traced logits (`stage_loss`, once the engine is built).
    """

    fn: Callable | None
    counts_items: bool
    subclass: bool = False
    stage_loss: SubclassLoss | None = None

    @property
    def name_prefix(self) -> str:
        """What the wrapped model's parameter names start with that the user model's lack."""
        return "model." if self.fn is not None else ""


class LossSetupMixin:
    """Mixed into `MerakTrainer` (which provides args, ctx, engine, loss_fn, ...)."""

    def _choose_loss(self, model: nn.Module) -> LossChoice:
        """The loss the last stage's graph computes (None: the model's own), and whether it is
        HF's token-weighted one (`merak.trainer.token_counts`): Merak's ``loss_fn`` when it
        takes ``num_items_in_batch``; HF's ``compute_loss_func`` always; label smoothing and the
        model's own loss when the model takes loss keyword arguments (HF's rules). With a
        subclass's ``compute_loss`` the graph ends at the logits, and the count is HF's
        whenever HF Trainer would pass one to ``compute_loss``."""
        if overrides(type(self), "compute_loss"):
            if self.loss_fn is not None:
                raise ValueError(f"{type(self).__name__} overrides compute_loss and was given "
                                 f"loss_fn: choose one")
            if not (shifts_labels(model) or classifies_sequences(model)):
                raise NotSupportedYetError(
                    f"a Trainer subclass's compute_loss runs on the last pipeline stage for "
                    f"causal language models and sequence classifiers; {type(model).__name__} "
                    f"is neither")
            return LossChoice(stage_logits, bool(self.model_accepts_loss_kwargs
                                                 or self.compute_loss_func is not None),
                              subclass=True)
        if self.loss_fn is not None:
            return LossChoice(self.loss_fn, takes_item_count(self.loss_fn))
        if self.compute_loss_func is not None:
            func = self.compute_loss_func

            def compute_loss_func(outputs, labels, num_items_in_batch=None):
                return func(outputs, labels, num_items_in_batch=num_items_in_batch)

            return LossChoice(compute_loss_func, True)
        if self.label_smoother is not None:  # label_smoothing_factor
            # HF's LabelSmoother on the logits the last stage makes (gathered whole by the
            # vocab-parallel LM head, so one TP rank's result is the full-vocabulary one)
            return LossChoice(LabelSmoothedLoss(self.label_smoother.epsilon,
                                                shifts_labels(model)),
                              self.model_accepts_loss_kwargs)
        if "labels" not in inspect.signature(model.forward).parameters:
            return LossChoice(default_loss_fn, False)  # the model computes no loss of its own
        return LossChoice(None, self.model_accepts_loss_kwargs)

    def _attach_subclass_loss(self, example: dict) -> None:
        """After the interpreter is built: the subclass's ``compute_loss`` on the last stage,
        its result weighted as HF's ``training_step`` weights it. Otherwise, with HF's counts,
        the micro-batch losses are summed, times dp when counted over dp."""
        args, choice = self.args, self.loss_choice
        if not choice.subclass:
            if choice.counts_items:
                self.engine.interpreter.loss_weight = \
                    self.ctx.dp if args.average_tokens_across_devices else 1
            return
        if args.parallel_vocab:
            raise NotSupportedYetError(
                "parallel_vocab with a Trainer subclass's compute_loss: compute_loss needs the "
                "whole vocabulary's logits on the last stage; turn parallel_vocab off")
        choice.stage_loss = SubclassLoss(self, self._user_model, list(example),
                                         self._model_inputs)
        self.engine.interpreter.attach_loss(choice.stage_loss)
        if self._run_reference_pass():  # TRL DPO's reference log-probs: new batch values
            choice.stage_loss.input_names = list(self._collate([self.train_dataset[0]]))
            self.engine.interpreter.attach_loss(choice.stage_loss)
        # None: each micro-batch's loss divided by the accumulation steps (HF's training_step)
        # (HF counts only batches with labels: TRL's reward and DPO batches have none)
        counted = choice.counts_items and "labels" in example
        self.engine.interpreter.loss_weight = \
            1 if scaled_for_accumulation(self, counted) else None

    def _traced_inputs(self, example: dict) -> dict:
        """What the pipeline runs of a micro-batch: with a subclass's compute_loss, the values
        it feeds the model (`merak.trainer.model_inputs`); else the whole batch, labels
        included."""
        if self.loss_choice.subclass:
            batch = {k: v for k, v in example.items() if k != ITEMS}  # compute_loss's count
            self._model_inputs = model_inputs(self, self._user_model, batch, self._joined_rows)
            return {k: example[k] for k in example if k in self._model_inputs or k == ITEMS}
        if "labels" not in example:
            raise ValueError("MerakTrainer trains on a loss: the batches need `labels` (add them "
                             "in the dataset or the data collator)")
        return example

    def _running_loss(self) -> AbstractContextManager:
        """Around training and evaluation steps: a subclass's compute_loss runs (not in
        probes)."""
        stage_loss = self.loss_choice.stage_loss
        return stage_loss.running() if stage_loss is not None else nullcontext()

    def _counted(self, batch: dict | list[dict] | None, microbatches: int,
                 step: bool = False) -> dict | list[dict] | None:
        """`batch` (one collated dict, or the list of a step's micro-batches) with HF's token
        counts when the loss takes them (see `token_counts`): the step's count in training
        (`step`), each micro-batch's own otherwise."""
        first = batch if isinstance(batch, dict) or batch is None else batch[0]
        if batch is None or not self.loss_choice.counts_items or "labels" not in first:
            return self._context_share(batch)
        if step:  # (counted over the whole rows, then cut into this cp rank's share)
            return self._context_share(with_step_count(
                batch, microbatches, self._shifted_count, self.ctx,
                self.args.average_tokens_across_devices))
        return self._context_share(with_own_counts(batch, microbatches, self._shifted_count))

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """HF's log, after every rank took the metrics a subclass recorded on the last stage
        (`share_metrics`)."""
        share_metrics(self)
        super().log(logs, *args, **kwargs)
