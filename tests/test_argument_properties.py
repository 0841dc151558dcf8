"""Property-based checks of `MerakArguments` (hypothesis): any combination of fields, valid or
not, either builds arguments a job can run with, or raises `ValueError` / `NotSupportedYetError`
naming a field the caller set; never another exception, never a value that fails later."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from merak import MerakArguments, NotSupportedYetError
from merak.schedule.registry import SCHEDULES
from merak.trainer.argument_ranges import INTEGERS, REALS

NAN, INF = math.nan, math.inf
ODD_REALS = [-4.0, -1.0, 0.0, 0.5, 1.0, 2.0, 128.0, NAN, INF, -INF]


def _reals(*usual: float) -> st.SearchStrategy:
    return st.sampled_from([*usual, *ODD_REALS])


FIELDS = {
    "per_device_train_batch_size": st.integers(-2, 4),
    "per_device_eval_batch_size": st.integers(-2, 4),
    "gradient_accumulation_steps": st.integers(-2, 4),
    "max_steps": st.integers(-3, 5),
    "num_train_epochs": _reals(3.0),
    "learning_rate": _reals(1e-3),
    "weight_decay": _reals(0.01),
    "adam_beta1": _reals(0.9),
    "adam_epsilon": _reals(1e-8),
    "max_grad_norm": _reals(1.0),
    "warmup_steps": _reals(0.1, 3.0),
    "label_smoothing_factor": _reals(0.1),
    "seed": st.sampled_from([-1, 0, 42, 2**32 - 1, 2**32]),
    "data_seed": st.sampled_from([None, -1, 7, 2**40]),
    "ddp_timeout": st.sampled_from([-5, 0, 1, 20, 1800]),
    "dataloader_num_workers": st.integers(-1, 2),
    "logging_steps": _reals(1.0, 10.0),
    "save_steps": st.sampled_from([-1, 0, 1, 0.5, 10]),
    "eval_strategy": st.sampled_from(["no", "steps"]),
    "eval_steps": st.sampled_from([None, -2, 0, 5]),
    "fp16": st.booleans(),
    "bf16": st.booleans(),
    "loss_scale": _reals(0.0, 1024.0),
    "initial_scale_power": st.sampled_from([-1, 0, 16, 32, 64, 65, 5000]),
    "min_loss_scale": _reals(1.0),
    "loss_scale_window": st.integers(-1, 3),
    "hysteresis": st.integers(-1, 3),
    "zero_stage": st.integers(-1, 4),
    "zero_reduce_bucket_size": st.sampled_from([-1, 0, 1, 500_000_000]),
    "ddp_bucket_cap_mb": st.sampled_from([None, -1, 0, 25, NAN]),
    "prescale_gradients": st.booleans(),
    "gradient_predivide_factor": _reals(1.0),
    "train_schedule": st.sampled_from([*SCHEDULES, "2f2b"]),
    "num_model_chunks": st.integers(-1, 4),
    "activation_checkpointing": st.booleans(),
    "checkpoint_num_layers": st.integers(-1, 3),
    "activation_checkpoint_ratio": st.none() | st.lists(_reals(0.5), min_size=1, max_size=3),
    "activation_memory_budget": st.none() | st.lists(_reals(64.0), min_size=1, max_size=2),
    "sequence_parallel": st.booleans(),
    "tp_overlapping_level": st.integers(-1, 3),
    "torch_compile": st.booleans(),
    "auto_find_batch_size": st.booleans(),
    "auto_parallel": st.booleans(),
    "plan_memory_gib": st.sampled_from([None, -1.0, 0.0, 2.0, NAN]),
    "plan_dry_runs": st.integers(-1, 4),
    "eval_iters": st.sampled_from([None, -1, 0, 3]),
    "text_generation": st.booleans(),
    "out_seq_length": st.integers(-1, 8),
    "temperature": _reals(0.9),
    "neftune_noise_alpha": st.sampled_from([None, -1.0, 0.0, 5.0, NAN]),
}
# the combinations alone: every number valid, the choices and switches free
CHOICES = {
    "per_device_train_batch_size": st.integers(1, 4),
    "gradient_accumulation_steps": st.integers(1, 4),
    "fp16": st.booleans(), "bf16": st.booleans(),
    "loss_scale": st.sampled_from([0.0, 1024.0]),
    "initial_scale_power": st.sampled_from([8, 16, 32]),
    "zero_stage": st.integers(0, 3),
    "zero_reduce_bucket_size": st.sampled_from([1000, 500_000_000]),
    "ddp_bucket_cap_mb": st.sampled_from([None, 25]),
    "prescale_gradients": st.booleans(),
    "gradient_predivide_factor": st.sampled_from([1.0, 2.0]),
    "train_schedule": st.sampled_from(list(SCHEDULES)),
    "num_model_chunks": st.integers(1, 4),
    "activation_checkpointing": st.booleans(),
    "gradient_checkpointing": st.booleans(),
    "checkpoint_num_layers": st.integers(1, 3),
    "activation_checkpoint_ratio": st.none() | st.lists(st.sampled_from([0.0, 0.5, 1.0]),
                                                        min_size=1, max_size=3),
    "activation_memory_budget": st.none() | st.just([64.0]),
    "sequence_parallel": st.booleans(),
    "tp_overlapping_level": st.integers(0, 2),
    "torch_compile": st.booleans(),
    "auto_find_batch_size": st.booleans(),
    "auto_parallel": st.booleans(),
    "plan_dry_runs": st.integers(1, 4),
    "text_generation": st.booleans(),
    "lora_config": st.none() | st.just('{"r": 4}'),
    "dealloc_pipeoutput": st.booleans(),
    "energy_gpu": st.sampled_from([None, "simulated"]),
    "eval_strategy": st.sampled_from(["no", "steps"]),
    "save_strategy": st.sampled_from(["no", "steps"]),
    "load_best_model_at_end": st.booleans(),
}
FIELD_NAMES = {f.name for f in dataclasses.fields(MerakArguments)}


def _finite_counts(args: MerakArguments) -> None:
    """What a built `MerakArguments` promises the job: every count and real in its range."""
    for name, (low, high, optional, _) in INTEGERS.items():
        value = getattr(args, name)
        assert (optional and value is None) or (low <= value and (high is None or value <= high))
    for name, (low, _, high, _, optional, _) in REALS.items():
        value = getattr(args, name)
        assert (optional and value is None) or (not math.isnan(value) and low <= value <= high)
    if args.fp16:
        assert math.isfinite(2.0 ** args.initial_scale_power)


def _names_one_of(error: Exception, fields: dict) -> None:
    named = {name for name in FIELD_NAMES if name in str(error)}
    assert named & set(fields), f"{type(error).__name__} names none of {sorted(fields)}: {error}"


def _builds_or_names_a_field(fields: dict) -> None:
    try:
        args = MerakArguments(output_dir="out", use_cpu=True, report_to="none", **fields)
    except (ValueError, NotSupportedYetError) as error:  # (NotSupportedYetError: a ValueError)
        _names_one_of(error, fields)
        return
    _finite_counts(args)
    for pp in (1, 2, 3):  # the engine's options for a layout (MerakTrainer makes them first)
        try:
            args.engine_options(pp=pp, dp=2)
        except ValueError as error:  # a per-stage list that does not fit this pp
            _names_one_of(error, fields)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=FIELDS))
def test_any_values_build_or_name_a_field_they_were_given(fields):
    _builds_or_names_a_field(fields)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=CHOICES))
def test_any_combination_builds_or_names_a_field_it_was_given(fields):
    _builds_or_names_a_field(fields)


@pytest.mark.parametrize("fields,message", [
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0: rows per micro-batch "
                                         "must be an integer >= 1; set it to 1 or more"),
    ({"per_device_train_batch_size": -1}, "per_device_train_batch_size=-1"),
    ({"gradient_accumulation_steps": -2}, "gradient_accumulation_steps=-2"),
    ({"zero_reduce_bucket_size": 0}, "zero_reduce_bucket_size=0"),
    ({"ddp_bucket_cap_mb": -1}, "ddp_bucket_cap_mb=-1: .* must be a number > 0"),
    ({"fp16": True, "loss_scale": -4}, "loss_scale=-4: .* >= 0"),
    ({"fp16": True, "initial_scale_power": 5000}, r"initial_scale_power=5000: .*\[0, 64\]"),
    ({"fp16": True, "min_loss_scale": 2.0**20}, "min_loss_scale=.* is above the initial"),
    ({"ddp_timeout": 0}, "ddp_timeout=0: seconds"),
    ({"learning_rate": NAN}, "learning_rate=nan"),
    ({"seed": -1}, r"seed=-1: .*\[0, 4294967295\]"),
    ({"per_device_train_batch_size": 2.5}, "per_device_train_batch_size=2.5: .* an integer"),
])
def test_each_range_error_names_the_field_the_value_and_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        MerakArguments(output_dir="out", use_cpu=True, **fields)
