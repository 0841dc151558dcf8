"""What `init_empty_weights` patches while a model is built (each returns its undo).

- ``param.data = <a copy of param>`` keeps the parameter's recorded writes (`meta`'s record).
- HF's ``from_pretrained`` tags the model it returns with where its weights are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# set on a model built by `from_pretrained` inside `init_empty_weights`: the directory (or hub
# id) its weights are to be loaded from, shard by shard, once the model is parallelized
PRETRAINED_ATTR = "merak_pretrained_from"


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _track_data_assignments(record) -> Callable[[], None]:
    """Make ``param.data = <a copy of param>`` (HF's `_adjust_bias` zero-pads tied biases this
    way) keep the parameter's recorded writes; returns the undo."""
    data = torch._C.TensorBase.data
    had_own = "data" in nn.Parameter.__dict__
    previous = nn.Parameter.__dict__.get("data")

    def set_data(param: nn.Parameter, new: torch.Tensor) -> None:
        if param.is_meta and isinstance(new, torch.Tensor) and new.is_meta:
            fresh, old = _storage_key(new), record.key(param)
            # a copy written since (e.g. re-initialized) keeps its own record instead
            if (fresh != _storage_key(param) and record.copies.get(fresh) == old
                    and fresh not in record.written):
                record.aliases[fresh] = old
        data.__set__(param, new)

    nn.Parameter.data = property(lambda param: data.__get__(param), set_data)

    def undo() -> None:
        if had_own:
            nn.Parameter.data = previous
        else:
            del nn.Parameter.data
    return undo


def _mark_from_pretrained() -> Callable[[], None]:
    """Make HF's ``PreTrainedModel.from_pretrained`` tag the model it returns with where its
    weights are (`PRETRAINED_ATTR`): only such a model is loaded from disk when parallelized. A
    model from ``from_config`` is initialized as the seeded full model would be, even when its
    config (and so its ``name_or_path``) came from a directory. Returns the undo."""
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # no transformers: nothing to mark
        return lambda: None
    had_own = "from_pretrained" in PreTrainedModel.__dict__
    previous = PreTrainedModel.__dict__.get("from_pretrained")
    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, **kwargs):
        out = original(cls, pretrained_model_name_or_path, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if isinstance(model, nn.Module) and pretrained_model_name_or_path is not None:
            object.__setattr__(model, PRETRAINED_ATTR, str(pretrained_model_name_or_path))
        return out

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)

    def undo() -> None:
        if had_own:
            PreTrainedModel.from_pretrained = previous
        else:
            del PreTrainedModel.from_pretrained
    return undo
