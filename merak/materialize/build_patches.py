"""What `init_empty_weights` patches while a model is built (each returns its undo).

- ``param.data = <a copy of param>`` keeps the parameter's recorded writes (`meta`'s record).
- HF's ``from_pretrained`` tags the model it returns with where its weights are.
- ``torch.tensor(data, device="meta")`` goes through the dispatch the meta record sees.
- ``torch.nn.init`` functions that skip meta tensors (``orthogonal_``, ``trunc_normal_``) are
  recorded as one op, run on real values at replay.
- ``torch.manual_seed`` (what ``transformers.set_seed`` calls) marks a reseed for the record.
"""

from __future__ import annotations

import types
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


def _note_reseeds(record) -> Callable[[], None]:
    """Make ``torch.manual_seed`` mark a reseed: the record's next draw then records the
    generator's state even where it equals the state at its previous draw. Meta draws leave the
    generator alone, so a reseed to the seed the model was built from (``set_seed(args.seed)``
    before peft adds adapters) gives the state of the build's first draw again, which a
    comparison of states takes for no change. Returns the undo."""
    original = torch.manual_seed

    def manual_seed(seed):
        generator = original(seed)
        record.last_state = None
        return generator

    torch.manual_seed = torch.random.manual_seed = manual_seed

    def undo() -> None:
        torch.manual_seed = torch.random.manual_seed = original
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


def _values_through_dispatch() -> Callable[[], None]:
    """Make ``torch.tensor(data, device="meta")`` (and ``as_tensor``, ``asarray``) build on the
    CPU and then move, through the ATen dispatch the meta record sees: made straight on the
    meta device, its values (RWKV's ``decay_speed`` lists) would be lost. Returns the undo."""
    originals = {name: getattr(torch, name) for name in ("tensor", "as_tensor", "asarray")}

    def through_cpu(original):
        def make(data, *args, **kwargs):
            device = kwargs.get("device")
            # not torch.get_default_device(): it calls torch.tensor, which is this function
            device = originals["tensor"]([]).device if device is None else torch.device(device)
            if isinstance(data, torch.Tensor) or device.type != "meta":
                return original(data, *args, **kwargs)
            requires_grad = kwargs.pop("requires_grad", False)
            out = original(data, *args, **{**kwargs, "device": "cpu"}).to("meta")
            return out.requires_grad_() if requires_grad else out
        return make

    for name, original in originals.items():
        setattr(torch, name, through_cpu(original))

    def undo() -> None:
        for name, original in originals.items():
            setattr(torch, name, original)
    return undo


# `torch.nn.init` functions that return at once on a meta tensor (and whose draws may depend
# on the values drawn: `trunc_normal_` rejects and redraws), so their ops never reach the record
_META_SKIPPING_INITS = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def _hook_template(*args, _merak_hook=None, **kwargs):
    return _merak_hook(*args, **kwargs)


def _inits_on_meta(record_call: Callable) -> Callable[[], None]:
    """Make each of the `_META_SKIPPING_INITS` call ``record_call(function, tensor, args,
    kwargs)`` (with a copy of the function as it was), so the record can keep the call as one op
    that the replay runs on real values (on a real tensor too: its draws may depend on the
    values drawn, which here are not the eager build's). The function objects are changed in
    place (their code), so references taken at import (HF's ``TORCH_INIT_FUNCTIONS``) are
    covered too. Returns the undo."""
    from torch.nn import init

    swapped = []
    for name in _META_SKIPPING_INITS:
        function = getattr(init, name, None)
        if function is None or function.__closure__:
            continue
        original = types.FunctionType(function.__code__, function.__globals__, name,
                                      function.__defaults__, None)
        original.__kwdefaults__ = function.__kwdefaults__

        def hook(tensor, *args, _original=original, **kwargs):
            if isinstance(tensor, torch.Tensor):
                return record_call(_original, tensor, args, kwargs)
            return _original(tensor, *args, **kwargs)

        swapped.append((function, function.__code__, function.__defaults__,
                        function.__kwdefaults__))
        function.__code__ = _hook_template.__code__
        function.__defaults__, function.__kwdefaults__ = None, {"_merak_hook": hook}

    def undo() -> None:
        for function, code, defaults, kwdefaults in swapped:
            function.__code__ = code
            function.__defaults__, function.__kwdefaults__ = defaults, kwdefaults
    return undo
