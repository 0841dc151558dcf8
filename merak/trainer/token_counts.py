"""HF Trainer's token-weighted loss (``num_items_in_batch``) for a pipeline step.

HF Trainer divides the step's summed token losses by the step's count of target tokens, over
all gradient-accumulation micro-batches and (with ``average_tokens_across_devices``, the
default) all data-parallel ranks, whenever the loss can take the count: the model's forward
takes ``**kwargs`` (``model_accepts_loss_kwargs``), or a ``compute_loss_func`` computes it.
The micro-batch losses are then summed, not averaged, and multiplied by the number of
data-parallel ranks so that the gradients' dp average gives the global sum (HF's
``compute_loss``). Averaging each micro-batch's mean instead differs whenever padding differs
between micro-batches, i.e. for almost every fine-tuning set.

Here the count travels with the batch as one more model input, ``num_items_in_batch``: an int64
tensor with one entry per micro-batch (split with the rows, or put in each micro-batch of a step
collated micro-batch by micro-batch, so each micro-batch gets its own shape-[1] count). In
training and evaluation every entry holds the step's count (an evaluation step is HF's
evaluation batch on each dp rank), found with one small all-reduce over the dp group on the
ranks that read the batch; the examples a pipeline is traced and measured on give each
micro-batch its own (`with_own_counts`). The count is computed on the host from the collated
labels, before the batch moves to the device, so the steady state reads nothing back from the
device.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist

from merak.distributed import liveness

ITEMS = "num_items_in_batch"
Batch = dict[str, torch.Tensor]


def takes_item_count(loss_fn) -> bool:
    """Whether a ``loss_fn(outputs, labels, ...)`` accepts ``num_items_in_batch``."""
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False
    return ITEMS in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _targets(batch: dict[str, torch.Tensor], shifted: bool) -> torch.Tensor:
    """The labels HF counts: ``shift_labels`` when the collator made them, else the labels past
    each row's first position for a loss that shifts them (causal LMs), else the labels."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return batch["labels"][..., 1:] if shifted else batch["labels"]


def target_counts(batch: Batch | Sequence[Batch], microbatches: int,
                  shifted: bool) -> torch.Tensor:
    """Per micro-batch, its target tokens as HF counts them (-100 is not a target): `batch`
    one collated dict cut into `microbatches` equal parts, or the micro-batches themselves."""
    if not isinstance(batch, dict):
        return torch.stack([_targets(part, shifted).ne(-100).sum() for part in batch])
    labels = _targets(batch, shifted)
    if labels.shape[0] % microbatches:
        raise ValueError(f"the batch's {labels.shape[0]} rows do not split into "
                         f"{microbatches} equal micro-batches")
    return labels.ne(-100).reshape(microbatches, -1).sum(1)


def _with_counts(batch: Batch | Sequence[Batch], counts: torch.Tensor
                 ) -> Batch | list[Batch]:
    """`batch` with one count per micro-batch: a shape-[1] tensor in each micro-batch."""
    if isinstance(batch, dict):
        return {**batch, ITEMS: counts}
    return [{**part, ITEMS: count.reshape(1)} for part, count in zip(batch, counts)]


def with_step_count(batch: Batch | Sequence[Batch], microbatches: int, shifted: bool, ctx,
                    across_dp: bool) -> Batch | list[Batch]:
    """The training batch with every micro-batch's count set to the step's: this rank's
    micro-batches, summed over the dp group when `across_dp` (every rank of a dp group reads
    the batch or none does: they hold the same stage)."""
    count = target_counts(batch, microbatches, shifted).sum().to(ctx.device)
    if across_dp and ctx.dp > 1:
        with liveness.waiting("the step's target-token count all-reduce (num_items_in_batch)",
                              group=ctx.dp_group):
            dist.all_reduce(count, group=ctx.dp_group)
    return _with_counts(batch, count.expand(microbatches).contiguous())


def with_own_counts(batch: Batch | Sequence[Batch], microbatches: int,
                    shifted: bool) -> Batch | list[Batch]:
    """The batch with each micro-batch's own count (evaluation, and the examples a pipeline
    is traced and measured on)."""
    return _with_counts(batch, target_counts(batch, microbatches, shifted))
