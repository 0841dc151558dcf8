"""Context parallelism in `MerakTrainer` (``merak.init(cp=)`` > 1, ``cp_mode``).

The cp ranks of a group read the same rows (they share their dp rank). Each collated
micro-batch is counted whole first (HF's token count of the step, over the whole rows), then
cut into this rank's load-balanced share (`merak.context_parallel.split_batch`: the labels
shifted before the cut, the position ids following their tokens); the model's attention is
wrapped through transformers' registry before the pipeline is traced, so the split traces and
the stages run on sequence shards (the activations the pipeline sends are shards too, and shape
discovery finds their shapes). Each rank's loss is its share of the rows' token-weighted loss;
the interpreter sums the shares' gradients over cp and averages over dp (the dp x cp replicas,
ZeRO included).

Refused, before anything is built: a loss other than the model's own token-weighted one (a
``loss_fn``, ``compute_loss_func``, label smoothing, a subclass's ``compute_loss``: they would
see one rank's share of the rows), a model whose forward takes no loss keyword arguments (the
row's token count must reach every share's loss), predictions and ``compute_metrics`` (the
logits are sequence shards), and what `merak.rules` refuses with cp.
"""

from __future__ import annotations

from merak import lora, rules
from merak.context_parallel import enable_context_parallel, split_batch, unsupported_reason
from merak.trainer.arguments import NotSupportedYetError


class ContextParallelMixin:
    """Mixed into `MerakTrainer` (which provides args, ctx, _user_model, the chosen loss)."""

    def _check_context_parallel(self, model) -> None:
        """At construction, after the loss is chosen."""
        ctx, args = self.ctx, self.args
        if ctx.cp == 1:
            return
        rules.check(rules.Choices.from_arguments(args, lora=lora.is_peft_model(model),
                                                 cp=ctx.cp))
        base = model.get_base_model() if lora.is_peft_model(model) else model
        reason = unsupported_reason(base, args.cp_mode)
        if reason is not None:
            raise NotSupportedYetError(f"context parallelism (cp={ctx.cp}): {reason}")
        own_loss = not (self.loss_choice.subclass or self.loss_fn is not None
                        or self.compute_loss_func is not None
                        or self.label_smoother is not None)
        if not own_loss:
            raise NotSupportedYetError(
                f"context parallelism (cp={ctx.cp}) trains on the model's own loss, which takes "
                f"each rank's share of the shifted labels; a loss_fn, compute_loss_func, label "
                f"smoothing or a subclass's compute_loss would see one rank's share of the rows")
        if not self.loss_choice.counts_items:
            raise NotSupportedYetError(
                f"context parallelism (cp={ctx.cp}) needs HF's token-weighted loss (each rank's "
                f"loss divided by the whole rows' token count): {type(base).__name__}'s "
                f"forward takes no loss keyword arguments (num_items_in_batch)")

    def _enable_context_parallel(self) -> None:
        """Before the pipeline is traced: the model attends across the split."""
        if self.ctx.cp > 1:
            enable_context_parallel(self._user_model, self.ctx.cp_group, self.args.cp_mode)

    def _context_share(self, batch):
        """This rank's share of `batch` (one collated dict, a step's micro-batches, or None)."""
        ctx = self.ctx
        if ctx.cp == 1 or batch is None:
            return batch
        if isinstance(batch, dict):
            return split_batch(batch, ctx.cp, ctx.cp_rank)
        return [split_batch(part, ctx.cp, ctx.cp_rank) for part in batch]

    def _check_predictions(self, predictions: bool) -> None:
        if predictions and self.ctx.cp > 1:
            raise NotSupportedYetError(
                f"predict() and compute_metrics with context parallelism (cp={self.ctx.cp}) are "
                f"not supported yet: the logits are sequence shards on the cp ranks; evaluate() "
                f"computes the loss")
