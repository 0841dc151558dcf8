"""`MerakTrainer` mixed with another HF `Trainer` subclass (TRL's trainers, a project's own):
what such a subclass may change, and how its constructor is called.

MerakTrainer runs a whole optimizer step as one pipeline schedule over every micro-batch
(`PipelineInterpreter.train_step`): HF's per-micro-batch ``training_step`` never runs, and the
loss is computed inside the last pipeline stage from that stage's outputs (the model's own
loss, ``loss_fn``, HF's ``compute_loss_func`` or label smoothing). A subclass that overrides
those methods would be silently ignored, so it is refused by name.
"""

from __future__ import annotations

import inspect

from transformers import Trainer

from merak.trainer.arguments import NotSupportedYetError

REFUSED_OVERRIDES = {
    "training_step": "a MerakTrainer step is one pipeline schedule over all of its "
                     "micro-batches, so a per-micro-batch training_step cannot run",
    "compute_loss": "the loss is computed inside the pipeline's last stage, where a "
                    "Trainer.compute_loss(model, inputs) has no whole model to call; give the "
                    "loss as MerakTrainer(loss_fn=fn) with fn(outputs, labels[, "
                    "num_items_in_batch]) or HF's compute_loss_func, which run there",
}


def check_overrides(cls: type) -> None:
    """Raise `NotSupportedYetError` naming the class and method of a refused override."""
    for name, reason in REFUSED_OVERRIDES.items():
        owner = next(k for k in cls.__mro__ if name in k.__dict__)
        if owner is not Trainer and not owner.__module__.startswith("merak."):
            raise NotSupportedYetError(
                f"{owner.__module__}.{owner.__qualname__}.{name} overrides Trainer.{name}, "
                f"which {cls.__name__} (a MerakTrainer) would never call: {reason}")


def trainer_keywords(positional: tuple, keywords: dict) -> dict:
    """HF Trainer's positional parameters after ``args`` (data_collator, train_dataset, ...)
    as keywords, so the next class's ``__init__`` receives them by name whatever its own
    order."""
    names = [n for n in inspect.signature(Trainer.__init__).parameters
             if n not in ("self", "model", "args")]
    if len(positional) > len(names):
        raise TypeError(f"MerakTrainer takes at most {len(names) + 2} positional arguments")
    clash = [n for n in names[:len(positional)] if n in keywords]
    if clash:
        raise TypeError(f"MerakTrainer got {clash[0]!r} both by position and by name")
    return {**dict(zip(names, positional)), **keywords}
