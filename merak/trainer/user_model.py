"""The one place `MerakTrainer` presents the user's whole model as ``trainer.model``.

Once the engine is built, ``trainer.model`` is this rank's pipeline stage (what HF's loop
trains). Some HF and TRL code reads ``self.model`` as the user's HF model instead: its config
and class (``create_model_card``), its gradient checkpointing and adapters (TRL's
``compute_ref_log_probs``). `user_model` puts the user's model there for the duration of such a
call and the stage back after it, whatever happens inside.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def user_model(trainer):
    """``trainer.model`` is the user's model (not this rank's stage) inside; unchanged before
    the engine is built (it is the user's model then)."""
    stage = trainer.model
    if trainer.stage is not None:
        trainer.model = trainer._user_model
    try:
        yield
    finally:
        trainer.model = stage
