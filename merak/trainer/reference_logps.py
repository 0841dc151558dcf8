"""TRL's ``DPOTrainer`` and ``KTOTrainer`` with ``precompute_ref_log_probs=True`` through
MerakTrainer: the reference log-probabilities computed by the pipeline, before the first
training step.

TRL computes them in its ``__init__`` (``_precompute_ref_logps(dataset, name, batch_size)``, as
read in TRL 1.16): forwards of the reference (the initial policy, as no ``ref_model`` is kept)
over the dataset, whose per-row results (``compute_ref_log_probs``) become the dataset's
``ref_chosen_logps`` and ``ref_rejected_logps`` columns. In MerakTrainer no rank holds the whole
model and the pipeline does not exist yet at that point, so `ReferenceLogpsMixin` takes that call
over: it notes the request, and once the pipeline is built (before anything trained it) runs the
pass as evaluation steps (eval mode, no gradients) over every row of the training set,
``batch_size`` rows per micro-batch and per dp rank. On the last stage each micro-batch's
results are TRL's own ``compute_ref_log_probs`` on a `StageModel` of its logits; every rank then
takes every row's values and adds the two columns to its training set, as TRL's dataset gets
them (KTO's: ``ref_logps`` and ``ref_KL_logps``, of its completions and of its mismatched KL
completions, both from one forward of a micro-batch, `merak.trainer.joined_rows`). With LoRA
adapters (TRL's ``peft_config``) the reference is the model with its adapters
off: the pass runs with every stage's adapters switched off (peft's own switch).

The evaluation sets given to DPOTrainer (``eval_dataset``, a dict of them too) take the same
pass, with the initial weights, before anything trained; a set given to ``evaluate(dataset)``
later is refused by name (`merak.trainer.evaluation`).
"""

from __future__ import annotations

import contextlib
import gc
import math

import numpy as np

from merak import lora
from merak.distributed.host_objects import all_gather_objects
from merak.trainer.reference_replica import build_replica, explicit_reference
from merak.trainer.reference_sync import SyncedReference, reference_columns
from merak.trainer.user_model import user_model


class ReferenceLogpsMixin:
    """Mixed into `MerakTrainer` (which provides args, ctx, engine, loss_choice, _collate)."""

    _pending_reference = None  # dataset name -> batch size of a reference pass TRL asked for
    # (no annotation: an annotated class attribute gives the mixin an __annotations__, a name
    # of Trainer's)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """TRL DPOTrainer's and KTOTrainer's hook (see the module doc): note the pass over the
        training set (``"train"``) or an evaluation set (``"eval"``, or its name in a dict of
        them) for when the pipeline exists; the dataset comes back unchanged until then."""
        self._pending_reference = {**(self._pending_reference or {}), name: batch_size}
        return dataset

    def _run_reference_pass(self) -> bool:
        """After the pipeline is built: the noted passes, if any; whether one ran. Their values
        become the datasets' columns TRL's loss reads: DPO's ``ref_chosen_logps`` and
        ``ref_rejected_logps``, KTO's ``ref_logps`` and (with its KL term) ``ref_KL_logps``."""
        if getattr(self.args, "sync_ref_model", False):  # the reference in every step
            self._start_synced_reference()
        pending, self._pending_reference = self._pending_reference or {}, None
        columns = reference_columns(type(self))
        reference = explicit_reference(self) if pending else None
        # an explicit ref_model: its frozen replica, split as the policy, for this pass only
        engine = self.engine if reference is None else build_replica(self, reference)
        try:
            for name, batch_size in pending.items():
                dataset = self._reference_dataset(name)
                for column, values in zip(columns, self._reference_logps(dataset, batch_size,
                                                                         engine),
                                          strict=True):
                    if values is not None:  # (KTO without its KL term computes none)
                        dataset = dataset.add_column(column, values)
                self._reference_dataset(name, dataset)
        finally:
            del engine
            gc.collect()
        return bool(pending)

    def _start_synced_reference(self) -> None:
        """``sync_ref_model``: the explicit reference's replica kept through training
        (`merak.trainer.reference_sync`); the last stage reads its values from each micro-batch,
        and TRL's own sync callback (over the whole models) makes way for the replica's."""
        from trl.trainer.callbacks import SyncRefModelCallback  # (trl: this is its trainer)

        if self._synced_reference is not None:  # (a rebuilt engine: a replica of its own)
            self.callback_handler.remove_callback(self._synced_reference)
        synced = SyncedReference(self, build_replica(self, explicit_reference(self)))
        self._synced_reference = synced
        self.callback_handler.remove_callback(SyncRefModelCallback)
        self.callback_handler.add_callback(synced)
        stage_loss = self.loss_choice.stage_loss
        stage_loss.input_names = list(dict.fromkeys([*stage_loss.input_names,
                                                        *synced.columns]))
        self.engine.interpreter.attach_loss(stage_loss)

    def _reference_dataset(self, name: str, dataset=None):
        """The dataset TRL named `name` (the training set, the evaluation set, or one of a dict
        of them); with `dataset`, put that in its place."""
        if name == "train":
            if dataset is not None:
                self.train_dataset = dataset
            return self.train_dataset
        if not isinstance(self.eval_dataset, dict):
            if dataset is not None:
                self.eval_dataset = dataset
            return self.eval_dataset
        if dataset is not None:
            self.eval_dataset = {**self.eval_dataset, name: dataset}
        return self.eval_dataset[name]

    def _reference_logps(self, dataset, batch_size: int, engine) -> list[np.ndarray | None]:
        """Every row's reference log-probabilities, on every rank: one array per value TRL's
        ``compute_ref_log_probs`` returns (None where it returned None), from `engine`'s
        stage (the policy's, or an explicit reference's replica)."""
        ctx, m = self.ctx, engine.interpreter.num_microbatches
        rows, local = len(dataset), batch_size * m
        steps = math.ceil(rows / (local * ctx.dp))
        mine: list[int] = []

        adapted = engine is self.engine and any(lora.is_lora_layer(m)
                                                for m in self.stage.modules())
        with contextlib.ExitStack() as stack:
            # LoRA: the reference is the model with its adapters off, on every stage
            adapters_off = stack.enter_context(lora.adapters_disabled(self.stage)) \
                if adapted else None

            def compute(model, inputs):
                values = self.compute_ref_log_probs(model, inputs)
                if adapters_off is not None:  # TRL's own adapter switch turned them on again
                    adapters_off()
                return [None if t is None else t.detach().float().cpu() for t in values]

            results = stack.enter_context(self.loss_choice.stage_loss.collecting(compute))
            stack.enter_context(user_model(self))
            for step in range(steps):
                first = (step * ctx.dp + ctx.dp_rank) * local
                microbatches = []
                for mb in range(m):
                    index = list(range(first + mb * batch_size,
                                       first + (mb + 1) * batch_size))
                    mine += index
                    # rows past the end: copies of row 0 whose results are dropped
                    microbatches.append(self._collate([dataset[i if i < rows else 0]
                                                       for i in index]))
                engine.interpreter.eval_step(microbatches, num_microbatches=m)
        last = ctx.pp_rank == engine.interpreter.placement[-1] and ctx.tp_rank == 0
        payload = (mine, results) if last else None
        columns: list[np.ndarray | None] | None = None
        for part in all_gather_objects(payload, group=ctx.host_group()):
            if part is None:
                continue
            index, values = part
            if columns is None:
                columns = [None if v is None else np.zeros(rows, np.float32)
                           for v in values[0]]
            for k, column in enumerate(columns):
                if column is None:
                    continue
                joined = np.concatenate([v[k] for v in values])
                for i, value in zip(index, joined, strict=True):
                    if i < rows:
                        column[i] = value
        return columns
