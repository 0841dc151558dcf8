"""`MerakTrainer` mixed with another HF `Trainer` subclass (TRL's trainers, a project's own):
what such a subclass may change, and how its constructor is called.

MerakTrainer runs a whole optimizer step as one pipeline schedule over every micro-batch
(`PipelineInterpreter.train_step`). A subclass's ``compute_loss`` runs on the last pipeline
stage, once per micro-batch (`merak.trainer.subclass_loss`). HF's per-micro-batch
``training_step`` never runs, so a subclass overriding it is refused by name, unless the
override is known to only wrap HF's step in a context that is off (`BYPASSED`). What of TRL's
DPOTrainer and KTOTrainer a pipeline cannot run yet is refused by name (`check_dpo`).
"""

from __future__ import annotations

import importlib.metadata
import inspect

from transformers import Trainer

from merak.trainer.arguments import NotSupportedYetError

_NO_STEP = ("a MerakTrainer step is one pipeline schedule over all of its micro-batches, so a "
            "per-micro-batch training_step cannot run; a subclass's compute_loss does run (on "
            "the last pipeline stage)")

# training_step overrides that only wrap HF's step in a context, as read in the versions listed:
# (module, class) -> (package, versions, is the context off?, why it cannot run when on)
BYPASSED = {
    ("trl.trainer.sft_trainer", "SFTTrainer"): ("trl", ("1.16.",),
        lambda args: not getattr(args, "activation_offloading", False),
        "activation_offloading=True: TRL's training_step moves the activations one "
        "micro-batch's forward saves to the CPU, and a pipeline stage keeps the activations of "
        "several micro-batches between forward and backward outside any training_step; save "
        "memory with activation_checkpointing (recomputation) instead"),
}
BYPASSED[("trl.trainer.dpo_trainer", "DPOTrainer")] = BYPASSED[("trl.trainer.sft_trainer",
                                                                "SFTTrainer")]
BYPASSED[("trl.trainer.reward_trainer", "RewardTrainer")] = \
    BYPASSED[("trl.trainer.sft_trainer", "SFTTrainer")]
BYPASSED[("trl.trainer.kto_trainer", "KTOTrainer")] = BYPASSED[("trl.trainer.sft_trainer",
                                                                "SFTTrainer")]
_DPO = ("trl.trainer.dpo_trainer", "DPOTrainer")
_REWARD = ("trl.trainer.reward_trainer", "RewardTrainer")
_KTO = ("trl.trainer.kto_trainer", "KTOTrainer")


def _owner(cls: type, name: str) -> type:
    return next(k for k in cls.__mro__ if name in k.__dict__)


def overrides(cls: type, name: str) -> bool:
    """Whether a class outside Merak and HF's `Trainer` defines `cls`'s method `name`."""
    owner = _owner(cls, name)
    return owner is not Trainer and not owner.__module__.startswith("merak.")


def check_overrides(cls: type, args) -> None:
    """Raise `NotSupportedYetError` naming the class and method of an override a pipeline
    cannot run, with the reason."""
    if not overrides(cls, "training_step"):
        return
    owner = _owner(cls, "training_step")
    where = f"{owner.__module__}.{owner.__qualname__}.training_step"
    bypass = BYPASSED.get((owner.__module__, owner.__qualname__))
    if bypass is None:
        raise NotSupportedYetError(f"{where} overrides Trainer.training_step, which "
                                   f"{cls.__name__} (a MerakTrainer) would never call: {_NO_STEP}")
    package, versions, is_off, why = bypass
    version = importlib.metadata.version(package)
    if not version.startswith(versions):
        raise NotSupportedYetError(f"{where} overrides Trainer.training_step; MerakTrainer "
                                   f"bypasses it only in {package} {', '.join(versions)}x (where "
                                   f"it only wraps HF's step), not {version}")
    if not is_off(args):
        raise NotSupportedYetError(f"{where} cannot run in {cls.__name__} (a MerakTrainer) "
                                   f"with {why}")


def is_dpo(cls: type) -> bool:
    """Whether `cls` is (a subclass of) TRL's DPOTrainer."""
    return _derives(cls, _DPO)


def reference_trainer(cls: type) -> str | None:
    """The module of TRL's trainer `cls` derives from that trains against a reference model
    (DPOTrainer, KTOTrainer), or None."""
    return next((module for module, name in (_DPO, _KTO) if _derives(cls, (module, name))),
                None)


def _derives(cls: type, which: tuple[str, str]) -> bool:
    return any((k.__module__, k.__qualname__) == which for k in cls.__mro__)


def is_reward(cls: type) -> bool:
    """Whether `cls` is (a subclass of) TRL's RewardTrainer, whose collator puts each
    example's chosen and rejected rows in one batch: its evaluation collates each
    micro-batch on its own items (`merak.trainer.evaluation`), so no pair is parted."""
    return _derives(cls, _REWARD)


def is_kto(cls: type) -> bool:
    """Whether `cls` is (a subclass of) TRL's KTOTrainer."""
    return _derives(cls, _KTO)


def check_dpo(cls: type, args, model, keywords: dict) -> None:
    """What of TRL's DPOTrainer and KTOTrainer a pipeline cannot run yet, refused by name with
    the reason, before anything is built (the reference log-probabilities run through the
    pipeline: `merak.trainer.reference_logps`)."""
    if not (is_dpo(cls) or is_kto(cls)):
        return
    name = cls.__name__
    if getattr(args, "sync_ref_model", False) and keywords.get("ref_model") is None:
        raise NotSupportedYetError(
            f"{name} with sync_ref_model=True and no ref_model: MerakTrainer keeps a replica of "
            f"an explicit reference in every step; give ref_model (e.g. the policy's checkpoint "
            f"loaded with from_pretrained inside merak.init_empty_weights())")
    if getattr(args, "sync_ref_model", False) and keywords.get("eval_dataset") is not None:
        raise NotSupportedYetError(
            f"{name} with sync_ref_model=True and an eval_dataset: the evaluation set's "
            f"reference would follow the policy too, and MerakTrainer computes it once before "
            f"training; evaluate without sync_ref_model")
    if hasattr(model, "peft_config") or getattr(args, "lora_config", None) is not None:
        raise NotSupportedYetError(
            f"{name} on a model that already carries adapters (a PeftModel, or "
            f"MerakArguments.lora_config): TRL then trains against a copy of them made in its "
            f"__init__, which MerakTrainer does not make; pass the LoraConfig as {name}'s "
            f"peft_config instead (the reference is then the model with its adapters off)")


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
