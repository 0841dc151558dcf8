"""`MerakArguments`' checks, one method per group of fields, run by its ``__post_init__``
(mixed into it); the refused combinations of options are `merak.rules`'."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from transformers import TrainingArguments

from merak.partition.options import SPLIT_METHODS, TRACE_METHODS
from merak.rules import NotSupportedYetError
from merak.schedule.registry import SCHEDULES
from merak.stages import assign
from merak.tensor_parallel.plans.tp_plan import as_tp_plan
from merak.trainer.hf_fields import CHECKPOINT_KWARGS, HONOURED, REFUSED


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


_OFF = (None, False, "no", "", (), [], {})


def _same(value: Any, default: Any) -> bool:
    """Equal, or both an 'off' spelling (the CLI parser turns some None/'no' into False)."""
    return value == default or (value in _OFF and default in _OFF)


class ArgumentChecks:
    """The checks of `MerakArguments`' fields (each raises `ValueError` or
    `NotSupportedYetError` naming the field)."""

    def _check_auto_parallel(self) -> None:
        if self.auto_parallel and self.plan:
            raise ValueError("MerakArguments: give auto_parallel=True (plan at train()) or "
                             "plan='plan.json' (a plan made before), not both")
        if not (self.auto_parallel or self.plan):
            extra = [n for n in ("plan_memory_gib",) if getattr(self, n) is not None]
            if extra or self.plan_dry_runs != 3:
                raise ValueError(f"MerakArguments.{(extra or ['plan_dry_runs'])[0]} only "
                                 f"applies with auto_parallel=True")
            return
        own = {f.name: f for f in dataclasses.fields(self)}
        chosen = [n for n in self.PLANNED if not _same(getattr(self, n), _default(own[n]))]
        if chosen:
            raise ValueError(f"MerakArguments.{chosen[0]} is chosen by the plan with "
                             f"{'auto_parallel' if self.auto_parallel else 'plan'}; leave it at "
                             f"its default")

    def _check_choices(self) -> None:
        choices = {
            "train_schedule": tuple(SCHEDULES),
            "partition_method": assign.PARTITION_METHODS,
            "split_method": SPLIT_METHODS, "trace_method": TRACE_METHODS,
            "zero_stage": (0, 1, 2, 3), "tp_overlapping_level": (0, 1, 2),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"MerakArguments.{name}={getattr(self, name)!r} is not one of "
                                 f"{list(allowed)}")
        if self.partition_method == "custom" and not self.custom_partition:
            raise ValueError("MerakArguments.partition_method='custom' needs custom_partition")
        if self.split_method == "layer_split" and not self.custom_split_points:
            raise ValueError("MerakArguments.split_method='layer_split' needs "
                             "custom_split_points")
        self._check_energy()
        self._check_schedule_and_recomputation()
        if self.sequence_dim not in (0, 1):
            raise ValueError(f"MerakArguments.sequence_dim must be 0 or 1, got "
                             f"{self.sequence_dim}")

    def _check_tp_plan(self) -> None:
        value = self.tp_plan
        if isinstance(value, str):  # from the command line
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"MerakArguments.tp_plan={self.tp_plan!r} is not a JSON object "
                                 f"({error})") from None
        try:
            self.tp_plan = as_tp_plan(value)
        except ValueError as error:
            raise ValueError(f"MerakArguments.tp_plan: {error}") from None

    def _check_energy(self) -> None:
        if self.energy_gpu not in (None, "nvml", "simulated"):
            raise ValueError(f"MerakArguments.energy_gpu={self.energy_gpu!r} is not one of "
                             f"[None, 'nvml', 'simulated']")
        if self.energy_mode not in (None, "auto"):
            raise ValueError(f"MerakArguments.energy_mode={self.energy_mode!r} is not one of "
                             f"[None, 'auto']")
        if not 0.0 <= self.energy_max_slowdown < 1.0:
            raise ValueError(f"MerakArguments.energy_max_slowdown must lie in [0, 1), got "
                             f"{self.energy_max_slowdown}")
        if self.energy_replan_margin <= 0:
            raise ValueError(f"MerakArguments.energy_replan_margin must be positive, got "
                             f"{self.energy_replan_margin}")
        wanted = [name for name in ("energy_mode", "energy_profile", "energy_plan",
                                    "pfo_server_url") if getattr(self, name)]
        if wanted and self.energy_gpu is None:
            raise ValueError(f"MerakArguments.{wanted[0]} needs a GPU to control: set "
                             f"energy_gpu='nvml' (NVIDIA GPUs) or 'simulated' (CPU machines)")
        if len(wanted) > 1:
            raise ValueError(f"MerakArguments: choose one of {wanted} (energy_mode='auto' does "
                             f"all in one run; or profile first, then train with a plan from a "
                             f"file or from a Perseus server)")
        if self.simulated_gpu is not None and self.energy_gpu != "simulated":
            raise ValueError("MerakArguments.simulated_gpu only applies with "
                             "energy_gpu='simulated'")

    def _check_schedule_and_recomputation(self) -> None:
        shaped = [n for n in ("activation_checkpoint_ratio", "activation_memory_budget")
                  if getattr(self, n) is not None]
        if not self.activation_checkpointing:
            extra = shaped + ["checkpoint_num_layers"] * (self.checkpoint_num_layers != 1) \
                + ["recompute_in_backward"] * self.recompute_in_backward
            if extra:
                raise ValueError(f"MerakArguments.{extra[0]} only applies with "
                                 f"activation_checkpointing=True")
        if len(shaped) > 1:
            raise ValueError("MerakArguments: give activation_checkpoint_ratio (fractions) or "
                             "activation_memory_budget (MiB), not both")
        if self.recompute_in_backward and self.checkpoint_num_layers != 1:
            raise ValueError("MerakArguments.recompute_in_backward reruns each block on its own "
                             "kept inputs: leave checkpoint_num_layers at 1")
        info = SCHEDULES[self.train_schedule]
        interleaved = info.several_stages_per_rank and info.fixed_stages_per_rank is None
        if not interleaved and self.num_model_chunks != 2:
            raise ValueError("MerakArguments.num_model_chunks only applies with "
                             "train_schedule='interleaved_1f1b' (zbv and dualpipev place 2 "
                             "stages on every rank, in a V)")
        if interleaved and self.num_model_chunks < 2:
            raise ValueError("MerakArguments.num_model_chunks must be >= 2 for interleaved_1f1b "
                             "(1 chunk per rank is train_schedule='1f1b')")

    def _check_buckets_and_scaler(self) -> None:
        own = {f.name: f for f in dataclasses.fields(self)}
        gather = own["zero_allgather_bucket_size"]
        if self.zero_allgather_bucket_size != _default(gather):
            raise ValueError(
                f"MerakArguments.zero_allgather_bucket_size={self.zero_allgather_bucket_size} "
                f"does not apply: ZeRO-2/3 (FSDP2) all-gather one block's parameters at a time "
                f"(each block is one fully_shard unit: the block is the bucket), and ZeRO-1 "
                f"broadcasts each rank's updated shard whole; leave it at its default "
                f"({_default(gather)})")
        if not self.fp16:
            for name in ("loss_scale", "initial_scale_power", "loss_scale_window",
                         "hysteresis", "consecutive_hysteresis", "min_loss_scale"):
                if getattr(self, name) != _default(own[name]):
                    raise ValueError(f"MerakArguments.{name} only applies with fp16=True")
        if self.fp16 and self.bf16:
            raise ValueError("MerakArguments: choose one of fp16 and bf16")
        if self.zero_stage >= 2:
            self._check_fsdp()
        elif self.zero_allow_untested_optimizer:
            raise ValueError("MerakArguments.zero_allow_untested_optimizer only applies with "
                             "zero_stage 2 or 3 (ZeRO-0/1 step whole parameters)")
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            raise ValueError("MerakArguments: prescale_gradients divides by dp before the "
                             "all-reduce; do not also set gradient_predivide_factor")
        if self.save and str(self.save_strategy).lower().endswith("no"):
            self.save_strategy = "steps"

    def _check_fp8(self) -> None:
        """The recipe's name, ``fp8_exclude`` only with fp8, and torchao installed; the
        combinations fp8 does not compose with yet are `merak.rules`'."""
        from merak.engine.fp8 import check_recipe

        check_recipe(self.fp8, "MerakArguments.fp8")
        if self.fp8 is None:
            if self.fp8_exclude:
                raise ValueError("MerakArguments.fp8_exclude only applies with fp8='tensorwise' "
                                 "or 'rowwise'")
            return
        try:
            import torchao.float8  # noqa: F401
        except ImportError as error:
            raise ImportError(f"MerakArguments.fp8={self.fp8!r} trains through torchao's "
                              f"float8 linears: pip install merak3d[fp8] ({error})") from None

    def _check_fsdp(self) -> None:
        """The bucket fields ZeRO-2/3 (FSDP2) ignores; its refused combinations are
        `merak.rules`'."""
        name = f"MerakArguments.zero_stage={self.zero_stage}"
        own = {f.name: f for f in dataclasses.fields(self)}
        for field_name in ("zero_reduce_bucket_size", "ddp_bucket_cap_mb"):
            if getattr(self, field_name) != _default(own[field_name]):
                raise ValueError(f"{name}: {field_name} does not apply: FSDP2 reduce-scatters "
                                 f"each block's gradients as one unit (the block is the "
                                 f"bucket); leave {field_name} at its default")

    def _check_gradient_checkpointing(self) -> None:
        """HF's `gradient_checkpointing=True` is Merak's recomputation: every block of every
        stage, as `activation_checkpointing=True` (whose ratio / budget / checkpoint_num_layers
        fields refine it). HF's own `model.gradient_checkpointing_enable()` is not called: the
        pipeline split traces the plain forward and the runtime recomputes the blocks."""
        kwargs = self.gradient_checkpointing_kwargs or {}
        kwargs = json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs)  # the CLI: JSON
        if kwargs and not self.gradient_checkpointing:
            raise ValueError("MerakArguments.gradient_checkpointing_kwargs only applies with "
                             "gradient_checkpointing=True")
        for key in kwargs:
            if key not in CHECKPOINT_KWARGS:
                raise NotSupportedYetError(
                    f"TrainingArguments.gradient_checkpointing_kwargs[{key!r}] is not supported "
                    f"yet by MerakTrainer (its recomputation is Merak's own, not "
                    f"torch.utils.checkpoint; it takes {sorted(CHECKPOINT_KWARGS)}, and "
                    f"activation_checkpoint_ratio / activation_memory_budget / "
                    f"checkpoint_num_layers to choose what is recomputed)")
        if self.gradient_checkpointing:
            self.activation_checkpointing = True

    def _check_inherited(self) -> None:
        own = {f.name for f in dataclasses.fields(self)} - {
            f.name for f in dataclasses.fields(TrainingArguments)}
        redefined = {"activation_checkpointing"}  # checked as a Merak field
        for f in dataclasses.fields(TrainingArguments):
            if f.name in HONOURED or f.name in redefined or f.name in own or not f.init:
                continue
            default = _default(f)
            if default is not dataclasses.MISSING and not _same(getattr(self, f.name), default):
                raise NotSupportedYetError(
                    f"TrainingArguments.{f.name}={getattr(self, f.name)!r} is not supported yet "
                    f"by MerakTrainer ({REFUSED.get(f.name, 'not implemented')}); leave it at "
                    f"its default ({default!r})")
        bucket = type(self).__dataclass_fields__["zero_reduce_bucket_size"]
        if self.ddp_bucket_cap_mb is not None and self.zero_reduce_bucket_size != _default(bucket):
            raise ValueError("MerakArguments: give the dp gradient bucket as ddp_bucket_cap_mb "
                             "(MiB) or zero_reduce_bucket_size (elements), not both")
