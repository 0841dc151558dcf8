"""TRL's ``DPOTrainer`` on a model built on the meta device (under `merak.init_empty_weights`):
what its ``__init__`` would read from whole weights, given without them.

With ``precompute_ref_log_probs=True`` TRL 1.16 hashes every tensor of the model in its
``__init__`` (``trl.trainer.dpo_trainer.hash_module``): the key of its dataset cache of reference
log-probabilities. A meta model has no values to hash, and a model too big for one device should
not be read whole on one rank anyway. MerakTrainer never reads TRL's cache (it computes the
reference log-probabilities through the pipeline on every run, `merak.trainer.reference_logps`),
so the key only has to be a deterministic name of the model: `weightless_hash` builds it from
what identifies the weights without reading them, the parameters' names, dtypes and shapes and
the files of the checkpoint each rank will load (their names, sizes and modification times).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from torch import nn

from merak.materialize.safetensors import pretrained_checkpoint


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
def weightless_dpo_init(trainer_class: type, model: nn.Module | None):
    """Inside: TRL's DPOTrainer hashes a meta `model` with `weightless_hash` (other trainers and
    models with weights are untouched)."""
    from merak.trainer.subclasses import is_dpo

    if model is None or not is_dpo(trainer_class) \
            or not any(p.is_meta for p in model.parameters()):
        yield
        return
    from unittest import mock

    import trl.trainer.dpo_trainer as dpo_trainer

    with mock.patch.object(dpo_trainer, "hash_module", weightless_hash):
        yield
