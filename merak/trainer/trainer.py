"""`MerakTrainer`: transformers' `Trainer` whose model is trained with Merak's 3D parallelism.

The user builds the model as usual (ideally inside `merak.init_empty_weights()`), calls
`merak.init(dp=, tp=, pp=)`, and hands both to `MerakTrainer`. On `train()` the trainer builds
this rank's stage with `merak.parallelize` (TP, automatic split, own shard materialized), then
runs one pipeline step per optimizer step: `gradient_accumulation_steps` micro-batches of
`per_device_train_batch_size` rows, with the HF optimizer, learning-rate scheduler, gradient
clipping (`max_grad_norm`), callbacks, logging and progress bar (rank 0).
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import TrainOutput, enable_full_determinism, set_seed

from merak import lora, rules
from merak.checkpoint.background import BackgroundSaves
from merak.distributed import liveness
from merak.distributed.parallel_context import get_context
from merak.distributed.timeouts import use_trainer_timeout
from merak.engine.assemble import Engine, build_engine
from merak.expert_parallel.shard import refuse_expert_adapters
from merak.materialize.adapters import adapters_join_record, check_adapters_recorded
from merak.materialize.safetensors import pretrained_checkpoint
from merak.runtime.memory_probe import fits_in_memory
from merak.trainer import neftune, recomputation
from merak.trainer.arguments import MerakArguments
from merak.trainer.auto_plan import apply_strategy_plan
from merak.trainer.checkpointing import CheckpointMixin
from merak.trainer.context_parallel import ContextParallelMixin
from merak.trainer.data import (
    StageBatches,
    check_eval_dataset,
    check_train_dataset,
    loader_options,
    model_input_filter,
)
from merak.trainer.dpo_setup import dpo_init, reference_before_training
from merak.trainer.energy_mode import EnergyMixin
from merak.trainer.evaluation import EvaluationMixin
from merak.trainer.flow import TrainingFlowMixin
from merak.trainer.joined_rows import kto_rows
from merak.trainer.loss_setup import LossSetupMixin
from merak.trainer.losses import shifts_labels
from merak.trainer.model_setup import with_loss
from merak.trainer.reference_logps import ReferenceLogpsMixin
from merak.trainer.subclasses import (
    check_dpo,
    check_overrides,
    trainer_keywords,
)
from merak.trainer.text_generation import TextGenerationMixin


class MerakTrainer(LossSetupMixin, ContextParallelMixin, ReferenceLogpsMixin, CheckpointMixin,
                   EvaluationMixin, TrainingFlowMixin, TextGenerationMixin, EnergyMixin,
                   Trainer):
    """A drop-in `transformers.Trainer` for models trained with dp x tp x pp.

    Args (besides `Trainer`'s):
        args: `MerakArguments`.
        loss_fn: ``loss_fn(outputs, labels) -> scalar``; default: the model's own loss (when
            the batch has labels and the model returns ``.loss``).
        leaf_modules: modules the automatic split keeps opaque (see `merak.auto_split`).
        generation_prompts: prompts (strings or token ids) for ``text_generation`` and
            `generate` (see `merak.trainer.text_generation`).
    """

    _joined_rows = None  # rows of several model calls run as one forward (joined_rows.py)
    _synced_reference = None  # sync_ref_model's reference replica (reference_sync.py)

    def __init__(self, model: nn.Module, args: MerakArguments, *trainer_args,
                 loss_fn: Callable | None = None, leaf_modules: Sequence[str] = (),
                 generation_prompts: Sequence | None = None, **trainer_kwargs):
        if not isinstance(args, MerakArguments):
            raise TypeError(f"MerakTrainer needs MerakArguments, got {type(args).__name__}")
        check_overrides(type(self), args)
        check_dpo(type(self), args, model, trainer_keywords(trainer_args, trainer_kwargs))
        self.ctx = get_context()
        if self.ctx.ep > 1:  # (the arguments may predate merak.init(ep=)): before any build
            rules.check(rules.Choices.from_arguments(args, lora=lora.is_peft_model(model)))
        use_trainer_timeout(args.ddp_timeout)  # every wait of the job: at most ddp_timeout
        if args.lora_config is not None:  # peft's LoRA layers, before anything is built,
            # made as single-process peft makes them right after set_seed(args.seed)
            model = lora.wrap(model, args.lora_config, args.adapter_name, seed=args.seed)
        refuse_expert_adapters(model, self.ctx.ep)  # ep > 1: no adapter on expert weights
        # by name: a Trainer subclass may take other parameters second (DPOTrainer: ref_model);
        # adapters it adds (TRL's peft_config) join the meta model's init record
        # (a DPOTrainer's reference: merak.trainer.dpo_setup)
        with adapters_join_record(model), dpo_init(type(self), model, args,
                                                   trainer_kwargs.get("ref_model")):
            super().__init__(model, args=args, **trainer_keywords(trainer_args, trainer_kwargs))
        reference_before_training(self)
        # KTO's completions and KL completions: rows of one pipeline forward
        self._joined_rows = kto_rows(self)
        if self.model is not None:
            model = self.model  # as the subclass left it (peft-wrapped)
            check_adapters_recorded(model)
            refuse_expert_adapters(model, self.ctx.ep)  # (and none a subclass added)
        # (peft config, adapter name): saves write the adapter as peft does
        self._lora = (model.peft_config[args.adapter_name], args.adapter_name) \
            if lora.is_peft_model(model) and args.adapter_name in model.peft_config else None
        self.loss_fn, self.leaf_modules = loss_fn, tuple(leaf_modules)
        base = model.get_base_model() if lora.is_peft_model(model) else model
        self.loss_choice = self._choose_loss(base)
        # HF's rule for which labels count (a causal LM's loss shifts them)
        self._shifted_count = getattr(self, "_loss_shifts_labels", shifts_labels(base))
        self._check_context_parallel(model)
        self._check_inputs()  # before any model is built from their first items
        self.generation_prompts, self.generations = generation_prompts, None
        self.engine: Engine | None = None  # built at train() (or for evaluation, generation)
        self._user_model = model
        self._saves = BackgroundSaves()  # `save_async`'s writer (checkpointing.py)
        self._input_filter = model_input_filter(model.forward, args.label_names or ("labels",)) \
            if args.remove_unused_columns else (lambda batch: batch)

    def _check_inputs(self, training: bool = False) -> None:
        """The engine's options for this layout build (a per-stage list fits pp); map-style
        sets with items; `training`: the training set holds one global batch
        (with auto_parallel or a plan file that is per_device_train_batch_size x
        gradient_accumulation_steps: the plan divides it over dp). A trainer made only to
        evaluate or predict may hold a smaller training set."""
        args = self.args
        if self.train_dataset is not None:
            planned = args.auto_parallel or bool(args.plan)
            rows = (args.per_device_train_batch_size, args.gradient_accumulation_steps,
                    1 if planned else self.ctx.dp) if training else (1, 1, 1)
            check_train_dataset(self.train_dataset, *rows)
        if self.eval_dataset is not None:
            check_eval_dataset(self.eval_dataset)
        if not (args.auto_parallel or args.plan):  # per-stage fields fit this layout
            args.engine_options(pp=self.ctx.pp, dp=self.ctx.dp)

    @property
    def stage(self):
        """This rank's pipeline stage (``engine.stage``; None before the engine is built)."""
        return None if self.engine is None else self.engine.stage

    def is_world_process_zero(self) -> bool:
        return self.ctx.rank == 0

    def is_local_process_zero(self) -> bool:
        return int(os.environ.get("LOCAL_RANK", self.ctx.rank)) == 0

    # ---------------------------------------------------------------- building the 3D model
    def _collate(self, items: list) -> dict[str, torch.Tensor]:
        batch = self._input_filter(dict(self.data_collator(items)))
        if self.args.input_names:
            batch = {k: v for k, v in batch.items() if k in (*self.args.input_names, "labels")}
        return batch if self._joined_rows is None else self._joined_rows.join(batch)

    def _assemble(self, example: dict[str, torch.Tensor]) -> None:
        """This rank's engine for the arguments (`merak.engine.build_engine`), traced on one
        collated micro-batch `example`."""
        if self.engine is not None:
            return
        args, model = self.args, self.model
        if lora.is_peft_model(model):  # the peft layers live in the model peft wraps
            model = model.get_base_model()
        self._user_model = model  # holds the TP random stream (model.merak_tp_rng)
        self._enable_context_parallel()  # before the trace: the stages attend across cp
        traced = self._traced_inputs(example)
        self._traced_example = traced  # (an explicit DPO reference's replica: the same trace)
        loss_fn = self.loss_choice.fn
        if loss_fn is not None:
            model = with_loss(model, loss_fn, list(traced))
        leaf_modules, embedding = self.leaf_modules, None
        if args.neftune_noise_alpha is not None:  # its forward hook must run: keep it opaque
            embedding = neftune.input_embedding(self._user_model)
            leaf_modules = (*leaf_modules, *neftune.opaque_modules(model, embedding))
        self.engine_options = args.engine_options(pp=self.ctx.pp, dp=self.ctx.dp,
                                                  leaf_modules=leaf_modules)
        self.neftune_noise = None
        if embedding is not None:  # HF's NEFTune, with noise the TP ranks of a group share
            self.neftune_noise = neftune.NEFTune(args.neftune_noise_alpha, args.seed,
                                                 self.ctx.dp_rank,
                                                 lambda: self.state.global_step)
        self._start_energy()

        def optimizer_over(stage):  # HF's create_optimizer, over this rank's stage
            self.model = self.model_wrapped = stage
            self.optimizer = None
            return self.create_optimizer()

        def neftune_hooks(stage):
            noise = self.neftune_noise
            return [noise] if noise is not None and noise.attach(stage, embedding) else []

        with liveness.waiting("building this rank's engine (split, shard load, groups)"):
            built = self._build(model, traced, optimizer_over, neftune_hooks)
        self.engine, self.optimizer = built, built.optimizer
        self._attach_subclass_loss(example)  # and the micro-batch losses' weights

    def _build(self, model, traced, optimizer_over, neftune_hooks):
        args = self.args
        return build_engine(
            model, traced, self.ctx, self.engine_options, make_optimizer=optimizer_over,
            checkpoint=pretrained_checkpoint(self._user_model),
            checkpoint_prefix=self.loss_choice.name_prefix,
            tp_rng=getattr(self._user_model, "merak_tp_rng", None), stage_hooks=neftune_hooks,
            hooks=[self.energy.engine_hook] if self.energy and not args.energy_profile else ())
        # (the profiler brings its own hook)

    def _find_micro_batch_size(self, size: int, num_microbatches: int) -> int:
        """HF's auto_find_batch_size for a pipeline: halve the micro-batch until a step fits in
        memory on every rank (`fits_in_memory`: each rank tries its share alone, then all
        agree), so no rank runs out of memory in the middle of a step its peers wait on. The
        split is traced for one micro-batch size, so each new size is a new build."""
        first = size
        while not fits_in_memory(self.engine.interpreter, self._example(self.train_dataset,
                                                            size * num_microbatches,
                                                            num_microbatches),
                                 num_microbatches):
            if size == 1:
                raise RuntimeError("auto_find_batch_size: a training step does not fit in device "
                                   "memory even with micro-batches of 1 row; turn on "
                                   "activation_checkpointing, or use more pipeline or tensor "
                                   "parallel ranks")
            size //= 2
            if self.is_world_process_zero():
                print(f"auto_find_batch_size: out of memory at {size * 2} rows per "
                      f"micro-batch, trying {size}")
            self.model, self.engine, self.optimizer = self._user_model, None, None
            gc.collect()
            if self.ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            self._assemble(self._example(self.train_dataset, size))
        if size != first and self.is_world_process_zero():
            print(f"auto_find_batch_size: training with {size} rows per micro-batch")
        return size

    def _batches(self, dataset, micro_batch_size: int, num_microbatches: int) -> StageBatches:
        return StageBatches(
            dataset, self._collate, micro_batch_size=micro_batch_size,
            num_microbatches=num_microbatches, dp=self.ctx.dp, dp_rank=self.ctx.dp_rank,
            strategy=self.args.train_sampling_strategy,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            reads_data=self.engine is None or bool(self.engine.interpreter.batch_keys),
            loader=loader_options(self.args))

    def _example(self, dataset, rows: int, microbatches: int = 1) -> dict | list[dict]:
        """The dataset's first `rows` items: one collated micro-batch (what the split is traced
        on), or a step of `microbatches` micro-batches collated one by one (the probes)."""
        size = rows // microbatches
        parts = [self._collate([dataset[i] for i in range(mb * size, (mb + 1) * size)])
                 for mb in range(microbatches)]
        return self._counted(parts[0] if microbatches == 1 else parts, microbatches)

    # ---------------------------------------------------------------- training
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs) -> TrainOutput:
        if trial is not None or kwargs:
            raise NotImplementedError("hyperparameter search is not supported by MerakTrainer")
        args = self.args
        if self.train_dataset is None:
            raise ValueError("MerakTrainer.train() needs a train_dataset")
        self._check_inputs(training=True)  # before the first items build anything
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        if (args.auto_parallel or args.plan) and self.engine is None:  # before building
            self.ctx = apply_strategy_plan(self, self._example(self.train_dataset, 1))
            self._check_context_parallel(self.model)  # (the plan may choose cp)
        resume_from_checkpoint = resume_from_checkpoint or args.resume_from_checkpoint
        if resume_from_checkpoint and self.engine is None:  # another dp: the same global batch
            resume_from_checkpoint = self._keep_global_batch(resume_from_checkpoint)
        mbs, m = args.per_device_train_batch_size, args.gradient_accumulation_steps
        self._assemble(self._example(self.train_dataset, mbs))
        self.stage.train()  # as HF's training step (a from_pretrained model comes in eval mode)
        if args.auto_find_batch_size:
            mbs = self._train_batch_size = self._find_micro_batch_size(mbs, m)
        recomputation.plan_recomputation(self.engine.interpreter, args,
                                         self._example(self.train_dataset, mbs * m, m))
        if self.energy is not None:  # the clock plan must fit the schedule that runs
            self.energy.attach(self.engine.interpreter)
        data = self._batches(self.train_dataset, mbs, m)
        steps_per_epoch = data.steps_per_epoch
        max_steps = args.max_steps if args.max_steps > 0 else \
            math.ceil(args.num_train_epochs * steps_per_epoch)
        epochs = math.ceil(max_steps / steps_per_epoch)
        self.create_scheduler(max_steps, self.optimizer)
        self.state = TrainerState(max_steps=max_steps, num_train_epochs=epochs,
                                  logging_steps=args.logging_steps,
                                  is_world_process_zero=self.is_world_process_zero(),
                                  is_local_process_zero=self.is_local_process_zero(),
                                  train_batch_size=mbs)
        if resume_from_checkpoint:
            self._resume_merak_checkpoint(resume_from_checkpoint)
        self._begin_flow(max_steps)
        first_step = self.state.global_step  # this call's steps start here (after a resume)
        first_epoch, skip = divmod(self.state.global_step, steps_per_epoch)
        if args.ignore_data_skip:  # HF: resume at the epoch's first batch, not past the seen ones
            skip = 0
        if args.energy_profile:
            return self._profile_energy(data)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        self._evaluate_on_start()
        tokens_per_step = None
        logged_loss, logged_steps, logged_time, total_loss = 0.0, 0, time.perf_counter(), 0.0
        start = time.perf_counter()
        for epoch in range(first_epoch, epochs):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            for batch in data.epoch(epoch, skip_steps=skip if epoch == first_epoch else 0):
                if self.state.global_step >= max_steps:
                    break
                self.control = self.callback_handler.on_step_begin(args, self.state,
                                                                   self.control)
                if tokens_per_step is None and batch is not None and "input_ids" in batch[0]:
                    tokens_per_step = sum(mb["input_ids"].numel() for mb in batch) * self.ctx.dp
                learning_rate = self.lr_scheduler.get_last_lr()[0]  # the one this step uses
                if self.energy is not None:
                    self.energy.step_begin(self.state.global_step + 1)
                if self._synced_reference is not None:  # its values for this step's rows
                    batch = self._synced_reference.step_values(batch)
                with self._running_loss():
                    loss = self.engine.interpreter.train_step(self._counted(batch, m, step=True))
                self._count_input_tokens(batch)
                self._empty_device_cache(self.state.global_step)
                if self.energy is not None:
                    self.energy.step_done(self.state.global_step + 1)
                skipped = self.engine.scaler is not None and self.engine.scaler.overflowed
                if not skipped:  # a step skipped on fp16 overflow leaves the schedule alone
                    self.lr_scheduler.step()
                self.state.global_step += 1
                self.state.epoch = epoch + (self.state.global_step - epoch * steps_per_epoch) \
                    / steps_per_epoch
                total_loss += loss
                logged_loss += loss
                logged_steps += 1
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                if self._should_log():
                    elapsed = time.perf_counter() - logged_time
                    logs = {"loss": logged_loss / logged_steps,
                            "grad_norm": self.engine.clipper.last_norm,
                            "learning_rate": learning_rate}
                    if tokens_per_step:
                        logs["tokens_per_second"] = round(
                            tokens_per_step * logged_steps / elapsed, 1)
                    if self.engine.timers:
                        logs.update(self.engine.timers.averages())
                    if self.energy is not None:
                        logs.update(self.energy.log_window())
                    if self.engine.scaler is not None:
                        logs.update(loss_scale=self.engine.scaler.scale,
                                    skipped_steps=self.engine.scaler.skipped_steps)
                    self.log(logs)
                    logged_loss, logged_steps, logged_time = 0.0, 0, time.perf_counter()
                self._merak_evaluate_and_save()
                if self.control.should_training_stop:
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._merak_evaluate_and_save()
            if self.control.should_training_stop or self.state.global_step >= max_steps:
                break
        runtime = time.perf_counter() - start
        steps_run = self.state.global_step - first_step
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(steps_run * mbs * m * self.ctx.dp
                                                     / runtime, 3),
                   "train_steps_per_second": round(steps_run / runtime, 3),
                   "train_loss": total_loss / max(steps_run, 1)}
        if self.energy is not None:
            self._energy_metrics(metrics)
        self._load_best_merak_checkpoint()
        if args.text_generation:
            self._generate_after_training()
        self.log(metrics)  # as HF: the run's metrics (and the epoch) in the log history
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self._finish_current_push()  # HF's: wait for the uploads of the saves
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    # ---------------------------------------------------------------- logging
    def _should_log(self) -> bool:
        step, args = self.state.global_step, self.args
        if args.logging_first_step and step == 1:
            return True
        return str(args.logging_strategy).endswith("steps") \
            and step % self._interval(args.logging_steps) == 0 \
            or self.control.should_log or step == self.state.max_steps
