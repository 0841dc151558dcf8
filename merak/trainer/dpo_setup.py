"""TRL's ``DPOTrainer`` and ``KTOTrainer`` on a model built on the meta device (under
`merak.init_empty_weights`): what their ``__init__`` would read from whole weights, given
without them.

With ``precompute_ref_log_probs=True`` TRL 1.16 hashes every tensor of the model in its
``__init__`` (``hash_module`` of ``trl.trainer.dpo_trainer`` and ``kto_trainer``): the key of
its dataset cache of reference log-probabilities. A meta model has no values to hash, and a
model too big for one device should not be read whole on one rank anyway. MerakTrainer never
reads TRL's cache (it computes the reference log-probabilities through the pipeline on every
run, `merak.trainer.reference_logps`), so the key only has to be a deterministic name of the
model: `weightless_hash` builds it from what identifies the weights without reading them, the
parameters' names, dtypes and shapes and the files of the checkpoint each rank will load (their
names, sizes and modification times).

Without ``precompute_ref_log_probs`` TRL loads a second, frozen copy of the model from its path
as the reference; the pipeline computes the same reference log-probabilities from the initial
weights instead (`reference_before_training`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from pathlib import Path
from unittest import mock

from torch import nn

from merak.materialize.safetensors import pretrained_checkpoint
from merak.trainer.subclasses import reference_trainer


def weightless_hash(module: nn.Module) -> str:
    """A deterministic key of `module`'s weights that reads none of their values."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    path = pretrained_checkpoint(base)
    if path is not None:
        for file in sorted(Path(path).iterdir()):
            if file.is_file():
                stat = file.stat()
                digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()


@contextlib.contextmanager
def dpo_init(trainer_class: type, model: nn.Module | None, args,
             reference: nn.Module | None = None):
    """Inside a DPOTrainer's or KTOTrainer's ``__init__``: a meta `model` (or meta explicit
    `reference`, its ``ref_model``) is hashed with `weightless_hash`; a meta `reference` stays
    where it is (accelerate would move it to the device whole: its replica's shards are loaded
    per rank, `merak.trainer.reference_replica`); without ``precompute_ref_log_probs`` no
    reference copy of the model is loaded (see `reference_before_training`). Other trainers are
    untouched."""
    module = reference_trainer(trainer_class)
    if module is None:
        yield
        return
    trainer_module = importlib.import_module(module)  # (trl: only where such a trainer is made)

    def is_meta(m: nn.Module | None) -> bool:
        return m is not None and any(p.is_meta for p in m.parameters())

    with contextlib.ExitStack() as stack:
        if is_meta(model) or is_meta(reference):
            stack.enter_context(mock.patch.object(trainer_module, "hash_module",
                                                  weightless_hash))
        if is_meta(reference):
            from accelerate import Accelerator

            prepare = Accelerator.prepare_model

            def prepare_model(accelerator, m, *a, **kw):
                return m if m is reference else prepare(accelerator, m, *a, **kw)

            stack.enter_context(mock.patch.object(Accelerator, "prepare_model", prepare_model))
        if not args.precompute_ref_log_probs:
            stack.enter_context(mock.patch.object(trainer_module, "create_model_from_path",
                                                  _no_reference_copy))
        yield


def _no_reference_copy(*_, **__) -> None:
    """In place of TRL's loading of a second, frozen copy of the model as the reference."""
    return None


def reference_before_training(trainer) -> None:
    """DPOTrainer or KTOTrainer without ``precompute_ref_log_probs``: its reference (a frozen
    copy of the initial model, or the model with its LoRA adapters off) never changes during
    training, so its log-probabilities on every training row are those of one forward-only
    pass of the pipeline with the initial weights before the first step, the pass precomputed
    references take (`merak.trainer.reference_logps`): exact, and no second copy of the
    weights on any rank (and so are those of its evaluation sets). TRL's loss then reads them
    from the batch, as with precomputed references."""
    args = trainer.args
    if reference_trainer(type(trainer)) is None or args.precompute_ref_log_probs:
        return
    trainer.precompute_ref_logps = True  # (TRL's loss reads the values from the batch)
    if getattr(args, "sync_ref_model", False):  # the replica runs in every step instead
        return  # (merak.trainer.reference_sync)
    trainer._precompute_ref_logps(trainer.train_dataset, "train", args.precompute_ref_batch_size
                                  or args.per_device_train_batch_size)
    evaluation = trainer.eval_dataset
    for name in (evaluation if isinstance(evaluation, dict) else
                 ["eval"] if evaluation is not None else []):
        trainer._precompute_ref_logps(None, name, args.precompute_ref_batch_size
                                      or args.per_device_eval_batch_size)
