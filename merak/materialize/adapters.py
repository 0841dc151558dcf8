"""Adapters that other code adds to a meta model join the model's init record.

A Trainer subclass may wrap the model it is given: TRL's ``SFTTrainer(peft_config=...)`` calls
peft's ``get_peft_model`` in its ``__init__``, right after ``set_seed(args.seed)``. peft
initializes each adapter as it creates it (LoRA's ``lora_A`` from the global generator), so the
values a single process gets are those drawn at that moment. On a meta model (built inside
`merak.init_empty_weights`) peft's draws would land on meta tensors outside the record and be
lost: materializing stops with "no value was recorded".

`adapters_join_record(model)`, around such an ``__init__`` (`MerakTrainer` puts it around its
``super().__init__``), makes every peft injection into `model` (``BaseTuner.inject_adapter``:
``get_peft_model``, ``add_adapter``) run inside ``init_empty_weights(record)`` of `model`'s
record, so each rank replays peft's own init at the generator state of the moment, after every
draw the model's build made; and it notes ``torch.manual_seed`` (``set_seed``) calls in between,
so a reseed to the seed the model was built from counts as one (`build_patches._note_reseeds`).
The adapters are then sharded with their tensor-parallel layers as ``lora_config``'s are.

Adapters added to a meta model outside it (a project's own ``get_peft_model`` before
`MerakTrainer`) have no recorded value, and the generator state they were drawn from is not
known afterwards: `check_adapters_recorded` names them and the ways that work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from merak.materialize.build_patches import _note_reseeds
from merak.materialize.meta import RECORD_ATTR, init_empty_weights, record_of


@contextlib.contextmanager
def adapters_join_record(model: nn.Module | None) -> Iterator[None]:
    """While inside, peft adapters injected into `model` (a meta model with an init record)
    join its record, initialized as peft initializes them on the whole model at that point.
    Nothing is patched for a model with no meta parameters or without peft installed."""
    record = record_of(model) if isinstance(model, nn.Module) and any(
        p.is_meta for p in model.parameters()) else None
    tuners = _peft_tuners() if record is not None else None
    if tuners is None:
        yield
        return
    original = vars(tuners.BaseTuner)["inject_adapter"]

    def inject_adapter(tuner, target: nn.Module, *args, **kwargs):
        if record.recording or record_of(target) is not record:
            return original(tuner, target, *args, **kwargs)
        with init_empty_weights(record):
            return original(tuner, target, *args, **kwargs)

    undo = _note_reseeds(record)
    tuners.BaseTuner.inject_adapter = inject_adapter
    try:
        yield
    finally:
        tuners.BaseTuner.inject_adapter = original
        undo()


def _peft_tuners():
    try:
        from peft.tuners import tuners_utils
    except ImportError:  # no peft: nobody can add peft adapters
        return None
    return tuners_utils


def check_adapters_recorded(model: nn.Module) -> None:
    """Refuse adapters on the meta device that joined no init record while the model's other
    parameters did: their initial values are unknown to every rank."""
    if record_of(model) is None:
        return
    lost = [name for name, p in model.named_parameters()
            if p.is_meta and ".lora_" in name and getattr(p, RECORD_ATTR, None) is None]
    if lost:
        raise ValueError(
            f"the LoRA adapters {lost[:2]}{' ...' if len(lost) > 2 else ''} were added to a model "
            f"built inside merak.init_empty_weights() outside its init record (get_peft_model "
            f"called on the meta model), so the values peft drew for them are lost and no rank "
            f"can initialize them. Let Merak add them: MerakArguments(lora_config=...), a "
            f"Trainer subclass's peft_config (TRL), or merak.lora.wrap(model, config); or call "
            f"get_peft_model inside `with merak.init_empty_weights(record_of(model)):` "
            f"(merak.materialize.meta.record_of)")
