"""An explicit reference model of TRL's DPOTrainer or KTOTrainer (``ref_model``: a second
model, e.g. an SFT'd checkpoint different from the policy) through the pipeline: a frozen,
forward-only replica of the reference's stage on each rank, built and split exactly as the
policy's (`merak.engine.build_engine` with the policy's engine options, traced on the policy's
micro-batch, its split checked piece by piece against the policy's), its tensor-parallel shards
as the policy's, its weights loaded from the reference's own checkpoint or initial values.

The reference never changes, so its log-probabilities are those of one forward-only pass of the
replica over the training (and evaluation) rows before the first step, micro-batch by
micro-batch, on the pass `merak.trainer.reference_logps` runs for precomputed references
(``reference_forward`` instructions: `merak.schedule.reference`, mode ``"before"``); the
replica is freed after it, so training holds no second copy. A reference that follows the
policy (``sync_ref_model``) keeps the replica through training (`merak.trainer.reference_sync`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from merak import lora
from merak.engine.assemble import Engine, build_engine
from merak.materialize.safetensors import pretrained_checkpoint
from merak.trainer.arguments import NotSupportedYetError
from merak.trainer.model_setup import with_loss


def explicit_reference(trainer) -> nn.Module | None:
    """The reference model TRL's ``__init__`` kept from the ``ref_model`` it was given (None:
    the reference is the initial policy, or the policy with its adapters off)."""
    return getattr(trainer, "ref_model", None)


def build_replica(trainer, reference: nn.Module) -> Engine:
    """This rank's frozen stage of `reference`, split and sharded as the policy's stage, with
    the trainer's last-stage loss (TRL's ``compute_ref_log_probs`` runs there)."""
    if lora.is_peft_model(reference):
        raise NotSupportedYetError(
            f"{type(trainer).__name__}'s ref_model carries peft adapters; merge them into the "
            f"reference (merge_and_unload) or give its base model")
    traced, policy = trainer._traced_example, trainer.engine.stage
    model = reference
    if trainer.loss_choice.fn is not None:
        model = with_loss(model, trainer.loss_choice.fn, list(traced))
    replica = build_engine(model, traced, trainer.ctx, trainer.engine_options,
                           make_optimizer=_never_stepped,
                           checkpoint=pretrained_checkpoint(reference),
                           checkpoint_prefix=trainer.loss_choice.name_prefix)
    ours, theirs = replica.stage.split, policy.split
    if ours.stage_of_piece != theirs.stage_of_piece or \
            [p.module for p in ours.pieces] != [p.module for p in theirs.pieces]:
        raise NotSupportedYetError(
            f"{type(trainer).__name__}'s ref_model splits into other pipeline stages than the "
            f"policy ({[p.module for p in ours.pieces]} against "
            f"{[p.module for p in theirs.pieces]}); give a reference of the policy's "
            f"architecture")
    replica.stage.requires_grad_(False)
    # what the replica holds on this rank (docs/preference-tuning.md): under ZeRO-2/3 its dp shards
    trainer.reference_replica_bytes = sum(
        t.numel() * t.element_size() for t in (p.to_local() if isinstance(p, DTensor) else p
                                               for p in replica.stage.parameters()))
    replica.interpreter.attach_loss(trainer.loss_choice.stage_loss)
    return replica


def _never_stepped(stage: nn.Module) -> torch.optim.Optimizer:
    """The replica's optimizer: the engine wants one; a frozen reference is never stepped."""
    return torch.optim.SGD(stage.parameters(), lr=0.0)
