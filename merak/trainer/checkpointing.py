"""`MerakTrainer`'s saving and loading: Merak checkpoints (every rank its shard, resumable into
any layout) and HF's `save_model` (one HF-format directory, gathered from the shards on rank 0).

HF `Trainer` names kept with their HF meaning: `_save(output_dir, state_dict)` writes the model
directory `save_model` asks for; `create_model_card` describes the user's model. Merak's own
checkpoint writer and reader are `_save_merak_checkpoint` / `_resume_merak_checkpoint`.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import HubStrategy

from merak import lora
from merak.checkpoint import io as checkpoint
from merak.checkpoint.export import gather_full_tensors, save_hf_directory
from merak.checkpoint.files import CheckpointError, check_trainer_state
from merak.distributed import liveness
from merak.materialize.meta import has_meta_parameters
from merak.trainer.user_model import user_model

# TrainerState fields a checkpoint keeps besides the step, epoch and log history
_BEST_STATE = ("best_metric", "best_global_step", "best_model_checkpoint",
               "num_input_tokens_seen")


def scheduler_state_for(state: dict, groups: int) -> dict:
    """A learning-rate scheduler's saved `state` fitted to an optimizer of `groups` parameter
    groups. The count depends on the layout: HF's `create_optimizer` gives each device mesh
    groups of its own, so ZeRO-2/3 with expert parallelism (the experts sharded over the edp
    group, the rest over the replicas) has more than ep=1 or ZeRO-0. When every saved group has
    the same schedule (the same base rate, last rate and schedule function, as HF's schedulers
    give them), each of the `groups` gets it.

    Raises:
        CheckpointError: the counts differ and the saved groups' schedules differ."""
    saved = len(state.get("base_lrs", ()))
    if not saved or saved == groups:
        return state
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, list) and len(value) == saved:
            if any(v != value[0] for v in value[1:]):
                raise CheckpointError(
                    f"the checkpoint's learning-rate scheduler has {saved} parameter groups "
                    f"with different {key} ({value}) and this run's optimizer has {groups} "
                    f"(each device mesh has groups of its own under ZeRO-2/3 with expert "
                    f"parallelism); resume in the saving run's ZeRO stage and ep, or give "
                    f"every parameter group the same schedule")
            out[key] = [copy.deepcopy(value[0]) for _ in range(groups)]
    return out


class CheckpointMixin:
    """Mixed into `MerakTrainer` (which provides args, ctx, stage, state, control, ...)."""

    def _interval(self, steps: float) -> int:
        """HF's `*_steps`: a step count, or below 1 a fraction of max_steps."""
        return int(steps) if steps >= 1 else max(1, int(steps * self.state.max_steps))

    @liveness.waiting_in(lambda self: f"saving checkpoint-{self.state.global_step}")
    def _save_merak_checkpoint(self) -> None:
        args = self.args
        best = self._best_checkpoint_dir()
        if best is not None:  # as HF's _save_checkpoint: the best one once it is on disk
            self.state.best_model_checkpoint = best
        state = {"scheduler": self.lr_scheduler.state_dict(), "zero_stage": args.zero_stage,
                 "trainer": {"global_step": self.state.global_step, "epoch": self.state.epoch,
                             "log_history": self.state.log_history,
                             **{k: getattr(self.state, k) for k in _BEST_STATE}}}
        if not (args.no_save_rng or args.save_only_model):
            state["rng"] = checkpoint.rng_states(self._user_model)
        if self.engine.scaler is not None:
            state["loss_scaler"] = self.engine.scaler.state_dict()
        adapter = None if self._lora is None else self._lora[0].save_pretrained
        path = checkpoint.save_checkpoint(  # (the adapter config: `merak export` reads it)
            args.output_dir, self.state.global_step, self.ctx, self.stage, state,
            save_total_limit=args.save_total_limit,
            config=getattr(self._user_model, "config", None),
            name_prefix=self.loss_choice.name_prefix,
            keep=self.state.best_model_checkpoint, before_marker=adapter,
            optimizer=None if args.no_save_optim or args.save_only_model else self.optimizer,
            background=self._saves if args.save_async else None,
            timeout_s=args.ddp_timeout, global_batch=self._global_batch())
        self.control.should_save = False
        self.control = self.callback_handler.on_save(args, self.state, self.control)
        if self.is_world_process_zero():
            print(f"{'saving' if args.save_async else 'saved'} {path}"
                  f"{' in the background' if args.save_async else ''}")
        if args.push_to_hub and args.hub_strategy != HubStrategy.END:
            self._push_merak_checkpoint(path)

    def _global_batch(self) -> int:
        """Rows per optimizer step: micro-batch x micro-batches x data-parallel ranks."""
        mbs = getattr(self, "_train_batch_size", None) or self.args.per_device_train_batch_size
        return mbs * self.args.gradient_accumulation_steps * self.ctx.dp

    def _keep_global_batch(self, resume_from_checkpoint):
        """A resume in a job of another data-parallel size keeps the checkpoint's global batch
        (so the run continues as it would have): the micro-batches per step are set to fit it,
        with a message; a clear error where the new layout cannot make it. Runs before the
        engine is built (its schedule has that many micro-batches). Returns the checkpoint it
        resolved (the resume reads that one), or `resume_from_checkpoint` with `finetune`."""
        args = self.args
        if args.finetune:  # only the weights: the new run's own batch
            return resume_from_checkpoint
        self._wait_for_saves()
        path = checkpoint.resolve(resume_from_checkpoint, args.output_dir)
        saved, mbs = checkpoint.read_layout(path).global_batch, args.per_device_train_batch_size
        rows = mbs * self.ctx.dp
        if saved is None or saved == rows * args.gradient_accumulation_steps:
            return path
        if saved % rows:
            raise ValueError(
                f"{path} was trained with a global batch of {saved} rows; this job has "
                f"dp={self.ctx.dp} x per_device_train_batch_size={mbs} = {rows} rows per "
                f"micro-batch step, which does not divide it: choose a per_device_train_batch_"
                f"size or dp dividing {saved}, or resume with finetune=True to start a new run "
                f"from its weights")
        before, args.gradient_accumulation_steps = args.gradient_accumulation_steps, saved // rows
        if self.is_world_process_zero():
            print(f"resuming {path} (global batch {saved} rows) with dp={self.ctx.dp}: "
                  f"gradient_accumulation_steps {before} -> {args.gradient_accumulation_steps} "
                  f"keeps the global batch")
        return path

    @liveness.waiting_in("waiting for the background save")
    def _wait_for_saves(self) -> None:
        """The background save in flight (if any) written and published; its error raised."""
        self._saves.wait()

    def _push_merak_checkpoint(self, path: Path) -> None:
        """HF's push at every save: output_dir becomes the HF model directory gathered from the
        shards (`_save`, a collective), then rank 0 uploads it, and for the 'checkpoint' /
        'all_checkpoints' strategies the (Merak-format, resumable) checkpoint folder too, with
        HF's own `_push_from_checkpoint` (which copies nothing else in: the checkpoint holds no
        HF weight files)."""
        self._wait_for_saves()  # (the folder pushed is complete)
        self._save(self.args.output_dir)
        self._push_from_checkpoint(str(path))

    @liveness.waiting_in("loading the checkpoint to resume from")
    def _resume_merak_checkpoint(self, resume_from_checkpoint) -> None:
        """Weights always; with `finetune` nothing else; otherwise optimizer, scheduler, RNG and
        the step (unless no_load_optim / no_load_rng)."""
        args = self.args
        self._wait_for_saves()
        path = checkpoint.resolve(resume_from_checkpoint, args.output_dir)
        state, same_layout = checkpoint.load_checkpoint(path, self.ctx, self.stage)
        if args.finetune:
            return
        saved = check_trainer_state(state, checkpoint.state_file_of(path, self.ctx, same_layout),
                                    checkpoint.read_layout(path).step)
        self.lr_scheduler.load_state_dict(scheduler_state_for(
            state["scheduler"], len(self.optimizer.param_groups)))
        if not args.no_load_optim:  # from any layout, ZeRO stage or schedule: resharded
            checkpoint.load_optimizer_state(path / checkpoint.OPTIMIZER_DIR, self.optimizer,
                                            self.stage)
            for group, rate in zip(self.optimizer.param_groups,
                                   self.lr_scheduler.get_last_lr()):
                group["lr"] = rate  # the saved step's (the scheduler's state)
        if self.engine.scaler is not None and "loss_scaler" in state:
            self.engine.scaler.load_state_dict(state["loss_scaler"])
        if not args.no_load_rng and "rng" in state:
            checkpoint.set_rng_states(state["rng"], self._user_model)
        self.state.global_step, self.state.epoch = saved["global_step"], saved["epoch"]
        self.state.log_history = saved["log_history"]
        for key in _BEST_STATE:
            setattr(self.state, key, saved.get(key, getattr(self.state, key)))
        best = self.state.best_model_checkpoint
        if best is not None and not os.path.isdir(best):  # as HF: rotated away or moved
            warnings.warn(f"the best checkpoint {best} recorded in {path} is gone; the best "
                          f"model is chosen again from the evaluations to come", stacklevel=2)
            self.state.best_model_checkpoint = None

    def _best_checkpoint_dir(self) -> str | None:
        """checkpoint-<best_global_step> when that step is being saved or was saved."""
        step = self.state.best_global_step
        if not step or str(self.args.save_strategy).lower().endswith("no"):
            return None
        path = os.path.join(self.args.output_dir, f"{checkpoint.PREFIX}{step}")
        return path if step == self.state.global_step or os.path.isdir(path) else None

    @liveness.waiting_in("loading the best checkpoint")
    def _load_best_merak_checkpoint(self) -> None:
        """`load_best_model_at_end`: every rank loads its shard of the best checkpoint's weights
        (any layout it was saved in); with save_total_limit=1 the others are then deleted, as
        HF does."""
        self._wait_for_saves()
        best = self.state.best_model_checkpoint
        if not self.args.load_best_model_at_end or best is None:
            return
        if self.is_world_process_zero():
            print(f"loading the best model from {best} ({self.args.metric_for_best_model}: "
                  f"{self.state.best_metric})")
        checkpoint.load_checkpoint(checkpoint.resolve(best, self.args.output_dir), self.ctx,
                                   self.stage)
        if self.args.save_total_limit == 1 and self.is_world_process_zero():
            for other in checkpoint.complete_checkpoints(self.args.output_dir):
                step = checkpoint.read_layout(other).step  # (`other` may be a kept copy)
                if other.with_name(f"{checkpoint.PREFIX}{step}").resolve() != \
                        Path(best).resolve():
                    checkpoint.remove_step(other.parent, step)
        if self.ctx.world_size > 1:
            dist.barrier()

    # ---------------------------------------------------------------- HF's save_model
    @liveness.waiting_in("save_model (gathering the shards)")
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """HF's meaning (what `save_model` calls): `output_dir` becomes an HF model directory
        (config.json, model.safetensors with the whole tensors, the tokenizer, training args),
        written by global rank 0 after gathering every (pp, tp) shard. A collective: every rank
        calls `save_model`, as HF scripts do."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._wait_for_saves()
        user_model = self._user_model if self.stage is not None else self.model
        if self.stage is not None:
            gathered = gather_full_tensors(self.stage, self.ctx,
                                           self.loss_choice.name_prefix)
            tensors = state_dict if state_dict is not None else gathered
        elif has_meta_parameters(user_model):
            raise ValueError("save_model() before train(): the model is still on the meta device "
                             "(init_empty_weights), so there are no weights to save yet")
        else:
            tensors = state_dict if state_dict is not None else user_model.state_dict()
        if self.is_world_process_zero() and self._lora is not None:  # as peft's save_pretrained
            lora.save_adapter_directory(tensors, *self._lora,
                                        getattr(user_model, "name_or_path", None), output_dir)
        elif self.is_world_process_zero():
            save_hf_directory(tensors, user_model, output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            elif getattr(self.data_collator, "tokenizer", None) is not None:
                self.data_collator.tokenizer.save_pretrained(output_dir)
            try:
                torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
            except Exception as error:  # noqa: BLE001 - e.g. a tp_plan holding a lambda
                warnings.warn(f"{TRAINING_ARGS_NAME} not written: the arguments do not pickle "
                              f"({error})", stacklevel=2)
        if self.ctx.world_size > 1:
            dist.barrier()

    def create_model_card(self, *args, **kwargs) -> None:
        with user_model(self):
            return super().create_model_card(*args, **kwargs)
