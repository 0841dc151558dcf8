"""TRL DPOTrainer's and KTOTrainer's ``sync_ref_model=True`` through the pipeline: the
reference follows the policy (every ``ref_model_sync_steps`` steps, reference <- alpha x policy
+ (1 - alpha) x reference, ``ref_model_mixup_alpha``), so it runs in every step.

The explicit ``ref_model``'s frozen replica (`merak.trainer.reference_replica`: split and
sharded exactly as the policy) is kept through training. Before each step it runs one
forward-only pass over the step's own micro-batches (TRL's ``compute_ref_log_probs`` on the
last stage, as in the pass before training), and its values join each micro-batch as the
columns TRL's loss reads (DPO's ``ref_chosen_logps`` and ``ref_rejected_logps``, KTO's
``ref_logps`` and ``ref_KL_logps``); so each micro-batch of the step runs its reference forward
just before its policy forward, in a schedule of its own (the planners' ``"replica"`` mode
times them inside the step: `merak.schedule.reference`).
After a step whose number is a multiple of ``ref_model_sync_steps`` each replica shard is mixed
with the policy's shard of the same name, as TRL's ``SyncRefModelCallback`` mixes the whole
models (the shards are the same slices of the same tensors, so the result is the same), and
TRL's callback, which would mix the whole user model, is removed.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from merak.trainer.subclasses import is_kto
from merak.trainer.user_model import user_model


def reference_columns(trainer_class: type) -> tuple[str, str]:
    """The batch columns TRL's loss reads the reference log-probabilities from, in the order
    ``compute_ref_log_probs`` returns them: DPO's of the chosen and rejected rows, KTO's of the
    completions and of the mismatched KL completions."""
    return ("ref_logps", "ref_KL_logps") if is_kto(trainer_class) \
        else ("ref_chosen_logps", "ref_rejected_logps")


class SyncedReference(TrainerCallback):
    """The replica through training: `step_values` before each step, the mixing after."""

    def __init__(self, trainer, replica):
        self.trainer, self.replica = trainer, replica
        policy = dict(trainer.engine.stage.named_parameters())
        mine = dict(replica.stage.named_parameters())
        if set(policy) != set(mine):
            raise RuntimeError(f"the reference replica's parameters {sorted(mine)} are not the "
                               f"policy stage's {sorted(policy)}")
        self.pairs = [(mine[name], policy[name]) for name in sorted(policy)]
        self.columns = reference_columns(type(trainer))

    def step_values(self, batch: list[dict] | None) -> list[dict] | None:
        """`batch` (this rank's micro-batches of the step) with the replica's reference
        log-probabilities of each micro-batch added where they were computed (the last stage's
        ranks, the only ones that read them). Every rank calls it (a pipeline pass)."""
        trainer = self.trainer
        m = self.replica.interpreter.num_microbatches

        def compute(model, inputs):
            return [None if t is None else t.detach()
                    for t in trainer.compute_ref_log_probs(model, inputs)]

        with trainer.loss_choice.stage_loss.collecting(compute) as results, user_model(trainer):
            self.replica.interpreter.eval_step(batch, num_microbatches=m)
        if self.replica.zero is not None:  # ZeRO-2 kept the replica's units whole: the mix
            self.replica.zero.reshard()  # updates the shards, which the next pass gathers
        if not results:
            return batch
        # (KTO without its KL term computes no KL values)
        return [{**mb, **{c: v for c, v in zip(self.columns, values, strict=True)
                          if v is not None}}
                for mb, values in zip(batch, results, strict=True)]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            alpha = args.ref_model_mixup_alpha
            with torch.no_grad():
                for reference, policy in self.pairs:
                    reference.mul_(1.0 - alpha).add_(policy, alpha=alpha)
        return control
