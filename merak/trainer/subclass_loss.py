"""A Trainer subclass's ``compute_loss`` run on the last pipeline stage, once per micro-batch,
and what it records reaching the logs.

`SubclassLoss` is the last stage's eager loss (`PipelineInterpreter.attach_loss`): the split
outputs the logits, and for each micro-batch it calls ``trainer.compute_loss(model, inputs,
num_items_in_batch=...)`` with HF's arguments: `inputs` the micro-batch's inputs (labels
included), the step's token count where HF Trainer counts one (`merak.trainer.token_counts`,
training only: HF's evaluation passes none), and a `StageModel` that answers as the whole model
for that micro-batch (one per row group of a joined micro-batch, `merak.trainer.joined_rows`:
TRL KTO's completions and KL completions). Its result is back-propagated as HF's
``training_step`` would: divided by the accumulation steps unless the loss is already scaled
for them (`scaled_for_accumulation`).

While ``compute_loss`` runs, the trainer's ``accelerator`` is `DataParallelView`: its processes
are the data-parallel ranks (the ranks holding different rows; tp and pp ranks share theirs), so
HF's and TRL's ``loss * num_processes`` and their metric gathers (``gather_for_metrics``) mean
what they mean on HF's data-parallel processes; gathers travel over the dp host group.

Metrics a subclass records in ``self._metrics`` (TRL's convention: mode -> name -> values, merged
into the logs by its ``log``) exist on the last stage's ranks only; `share_metrics` hands them to
every rank before each log, so the logging rank (global rank 0, on the first stage) logs them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from merak.distributed.host_objects import all_gather_objects, broadcast_object
from merak.trainer.arguments import NotSupportedYetError
from merak.trainer.joined_rows import JoinedModel
from merak.trainer.stage_model import StageModel
from merak.trainer.token_counts import ITEMS


def stage_logits(outputs, labels, num_items_in_batch=None) -> torch.Tensor:
    """The split's output when a subclass computes the loss: the model's logits."""
    return outputs["logits"] if isinstance(outputs, dict) else outputs.logits


def scaled_for_accumulation(trainer, counted: bool) -> bool:
    """HF ``training_step``'s rule: is ``compute_loss``'s result already scaled for gradient
    accumulation (else it is divided by the accumulation steps)?"""
    declared = getattr(trainer, "loss_is_scaled_for_ga", None)
    if declared is not None:
        return bool(declared)
    return bool(trainer.model_accepts_loss_kwargs and counted) \
        or trainer.compute_loss_func is not None


class DataParallelView:
    """The trainer's accelerator as ``compute_loss`` sees it on the last stage: processes are the
    dp ranks; ``gather``/``gather_for_metrics`` concatenate a tensor over them (in dp-rank
    order, as accelerate does over its processes). Everything else is the real accelerator's."""

    def __init__(self, accelerator, ctx):
        self._accelerator, self._ctx = accelerator, ctx

    @property
    def num_processes(self) -> int:
        return self._ctx.dp

    @property
    def process_index(self) -> int:
        return self._ctx.dp_rank

    @property
    def is_main_process(self) -> bool:
        return self._ctx.dp_rank == 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(tensor):
            raise NotSupportedYetError(f"compute_loss gathered a {type(tensor).__name__} over "
                                       f"the processes; on a pipeline only tensors are gathered")
        part = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
        if self._ctx.dp == 1:
            return part
        parts = all_gather_objects(part.cpu(), group=self._ctx.host_group("dp"))
        return torch.cat(parts).to(tensor.device)

    def gather_for_metrics(self, tensor: torch.Tensor, use_gather_object: bool = False
                           ) -> torch.Tensor:
        return self.gather(tensor)

    def __getattr__(self, name: str):
        return getattr(self._accelerator, name)


class SubclassLoss:
    """The last stage's loss: the trainer's ``compute_loss`` on one micro-batch (see the module
    doc). `input_names`: the batch values it reads (every collated input, and the count).
    ``live`` False (the trainer's probes: memory, recomputation plans): the model's own loss,
    so a probe records nothing in the subclass's metrics. `model_inputs`: the values the
    pipeline ran (`merak.trainer.model_inputs`), which `StageModel` answers for.
    `collecting(fn)`: an evaluation pass that calls ``fn(model, inputs)`` per micro-batch instead
    of ``compute_loss`` and keeps its results in ``collected`` (TRL's reference log-probs)."""

    def __init__(self, trainer, user_model, input_names: Sequence[str],
                 model_inputs: Sequence[str]):
        self.trainer, self.user_model = trainer, user_model
        self.input_names, self.model_inputs = list(input_names), list(model_inputs)
        self.live, self.collector, self.collected = False, None, []

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Training and evaluation steps: ``compute_loss`` runs."""
        self.live = True
        try:
            yield
        finally:
            self.live = False

    @contextlib.contextmanager
    def collecting(self, fn) -> Iterator[list]:
        self.collector, self.collected = fn, []
        try:
            yield self.collected
        finally:
            self.collector = None

    def __call__(self, logits: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        trainer = self.trainer
        inputs = dict(inputs)
        count = inputs.pop(ITEMS, None)
        training = trainer.model.training
        ran = {k: inputs[k] for k in self.model_inputs}
        if not self.live and self.collector is None:
            loss = StageModel(logits, ran, self.user_model, training)(**ran).loss
            # a probe of a loss without labels (DPO's): one that reaches every logit
            return loss if loss is not None else logits.float().mean()
        joined = getattr(trainer, "_joined_rows", None)
        if joined is None:
            model = StageModel(logits, ran, self.user_model, training)
        else:  # rows of several model calls in one forward (merak.trainer.joined_rows)
            inputs = joined.split(inputs)
            model = JoinedModel([StageModel(logits[rows][:, :width], values, self.user_model,
                                            training)
                                 for rows, width, values in joined.parts(inputs)])
        if self.collector is not None:
            self.collected.append(self.collector(model, inputs))
            return logits.new_zeros(())
        # HF passes the step's count (a float tensor) in training, none in evaluation
        count = count.reshape(()).float() if count is not None and training else None
        view, real = DataParallelView(trainer.accelerator, trainer.ctx), trainer.accelerator
        trainer.accelerator = view
        try:
            loss = trainer.compute_loss(model, inputs, num_items_in_batch=count)
        finally:
            trainer.accelerator = real
        if isinstance(loss, tuple):
            loss = loss[0]
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise TypeError(f"{type(trainer).__name__}.compute_loss returned "
                            f"{type(loss).__name__}, not a scalar loss tensor")
        return loss.reshape(())


def share_metrics(trainer) -> None:
    """Every rank takes the metrics the last stage's ranks recorded in ``trainer._metrics``
    (TRL's convention; equal on all of them: their gathers span the dp ranks); a collective of
    every rank, called before each log."""
    ctx = trainer.ctx
    if ctx.pp == 1 or not hasattr(trainer, "_metrics"):
        return
    last = trainer.engine.interpreter.placement[-1]  # the pipeline rank of the last stage
    source = ctx.rank_of(pp_rank=last, dp_rank=0, tp_rank=0)
    trainer._metrics = broadcast_object(trainer._metrics, source, group=ctx.host_group())
