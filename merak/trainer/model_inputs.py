"""Which of a collated micro-batch's values the pipeline runs, when a Trainer subclass's
``compute_loss`` calls the model on only some of them.

A subclass's collator may return values its loss reads but the model never sees: TRL's
``DPOTrainer`` collates each prompt's chosen and rejected rows into one batch (chosen first) with
``completion_mask`` and the precomputed reference log-probabilities beside them, and calls the
model on ``input_ids`` and ``attention_mask`` only. The pipeline must run exactly the inputs the
subclass's forward feeds the model: `model_inputs` learns them by calling ``compute_loss`` once
on an example micro-batch with a `Recorder` as the model, which keeps the call's keywords and
stops ``compute_loss`` there (before it computes or records anything from outputs). The model
inputs are the call's keywords whose value is the micro-batch's own value; the rest of the
micro-batch still reaches ``compute_loss`` on the last stage.
"""

from __future__ import annotations

import torch

from merak.trainer.arguments import NotSupportedYetError


class _Recorded(BaseException):
    """Stops ``compute_loss`` at its model call (a BaseException: ``except Exception`` in a
    subclass's code does not catch it)."""


class Recorder:
    """Stands for the model in ``compute_loss``: records the keywords of its first call."""

    def __init__(self, user_model):
        self.user_model, self.keywords = user_model, None

    def __call__(self, *args, **kwargs):
        if args:
            raise NotSupportedYetError(f"compute_loss called the model with {len(args)} "
                                       f"positional arguments; pass the inputs by name")
        self.keywords = kwargs
        raise _Recorded

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.user_model, name)


def _same(mine, value) -> bool:
    if mine is value:
        return True
    return torch.is_tensor(mine) and torch.is_tensor(value) and mine.shape == value.shape \
        and torch.equal(mine, value)


def model_inputs(trainer, user_model, example: dict, joined=None) -> list[str]:
    """The names of `example`'s values that ``trainer.compute_loss`` feeds the model (in the
    example's order), learned from one call of it (see the module doc). `joined`
    (`merak.trainer.joined_rows.JoinedRows`, `example` joined by it): the call must pass one of
    its row groups; the pipeline runs the joined inputs."""
    recorder = Recorder(user_model)
    own = joined.split(example) if joined is not None else example
    try:
        trainer.compute_loss(recorder, dict(own))
    except _Recorded:
        pass
    if recorder.keywords is None:
        raise NotSupportedYetError(
            f"{type(trainer).__name__}.compute_loss returned without calling the model on the "
            f"micro-batch; a pipeline runs the model before compute_loss, so it must know the "
            f"inputs compute_loss feeds it")
    if joined is not None:
        called = recorder.keywords
        if not any(all(name in called and _same(own[key], called[name])
                       for name, key in group.items()) for group in joined.groups):
            raise NotSupportedYetError(
                f"{type(trainer).__name__}.compute_loss called the model with "
                f"{sorted(called)}, none of them a row group of the micro-batch "
                f"({[sorted(g.values()) for g in joined.groups]})")
        return joined.names
    names = [n for n in example if n in recorder.keywords and _same(example[n],
                                                                     recorder.keywords[n])]
    if not any(torch.is_tensor(example[n]) for n in names):
        raise NotSupportedYetError(
            f"{type(trainer).__name__}.compute_loss called the model with "
            f"{sorted(recorder.keywords)}, none of them the micro-batch's tensors "
            f"({sorted(example)}): the pipeline runs the micro-batch's own values")
    return names
