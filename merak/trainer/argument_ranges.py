"""The range of every numeric `MerakArguments` field, HF's inherited ones included, checked when
the arguments are made: before any process group, model or data loader exists. A value out of
range would otherwise fail much later, deep inside (a zero micro-batch as a bare `IndexError` in
HF's collator, a zero bucket after the model is built, ``2 ** 5000`` as an `OverflowError`), or
not fail at all (a NaN learning rate). Each error names the field, its value and the fix.

Fields whose meaning HF gives to zero or negative values keep it: ``max_steps <= 0`` trains
``num_train_epochs``, ``max_grad_norm <= 0`` does not clip, ``save_total_limit <= 0`` keeps
every checkpoint.
"""

from __future__ import annotations

import math
from numbers import Real

# integer fields: (smallest, largest or None, may be None, what the value is)
INTEGERS = {
    "per_device_train_batch_size": (1, None, False, "rows per micro-batch"),
    "per_device_eval_batch_size": (1, None, False, "rows per evaluation micro-batch"),
    "gradient_accumulation_steps": (1, None, False, "micro-batches per optimizer step"),
    "zero_reduce_bucket_size": (1, None, False, "elements per dp gradient all-reduce bucket"),
    "zero_allgather_bucket_size": (1, None, False, "elements per all-gather bucket"),
    "ddp_timeout": (1, None, False, "seconds any wait for the other ranks may last"),
    "dataloader_num_workers": (0, None, False, "data-loading processes (0: the main one)"),
    "dataloader_prefetch_factor": (1, None, True, "batches each loading process reads ahead"),
    "eval_accumulation_steps": (1, None, True, "evaluation steps between gathers"),
    "eval_iters": (1, None, True, "evaluation steps per evaluate()"),
    "checkpoint_num_layers": (1, None, False, "blocks per recomputed segment"),
    "out_seq_length": (1, None, False, "new tokens per prompt"),
    "loss_scale_window": (1, None, False, "clean steps before the fp16 scale grows"),
    "hysteresis": (1, None, False, "overflows absorbed before the fp16 scale halves"),
    "num_model_chunks": (1, None, False, "model chunks per pipeline rank"),
    "plan_dry_runs": (1, None, False, "candidates the planner runs"),
    "initial_scale_power": (0, 64, False, "the dynamic fp16 scale's power of 2 "
                                          "(DeepSpeed's default: 16)"),
    "seed": (0, 2**32 - 1, False, "the random seed (numpy's range)"),
    "data_seed": (0, 2**32 - 1, True, "the data order's seed (numpy's range)"),
}

# real fields: (lower, lower included, upper, upper included, may be None, what the value is)
INF = math.inf
REALS = {
    "learning_rate": (0, True, INF, False, False, "the optimizer's step size"),
    "weight_decay": (0, True, INF, False, False, "the decoupled weight decay"),
    "adam_beta1": (0, True, 1, False, False, "Adam's first-moment decay"),
    "adam_beta2": (0, True, 1, False, False, "Adam's second-moment decay"),
    "adam_epsilon": (0, True, INF, False, False, "Adam's denominator term"),
    "max_grad_norm": (-INF, False, INF, True, False, "the clipping norm (<= 0: none)"),
    "num_train_epochs": (0, True, INF, False, False, "epochs to train when max_steps <= 0"),
    "warmup_steps": (0, True, INF, False, False, "warm-up steps (below 1: a fraction)"),
    "eval_delay": (0, True, INF, False, False, "steps or epochs before the first evaluation"),
    "label_smoothing_factor": (0, True, 1, False, False, "the label smoothing epsilon"),
    "neftune_noise_alpha": (0, False, INF, False, True, "NEFTune's noise scale"),
    "loss_scale": (0, True, INF, False, False, "the static fp16 scale (0: dynamic)"),
    "min_loss_scale": (0, False, INF, False, False, "the lowest dynamic fp16 scale"),
    "gradient_predivide_factor": (0, False, INF, False, False, "the dp pre-division"),
    "temperature": (0, True, INF, False, False, "the sampling temperature (0: greedy)"),
    "plan_memory_gib": (0, False, INF, False, True, "the planner's memory per rank, GiB"),
    "ddp_bucket_cap_mb": (0, False, INF, False, True, "MiB per dp gradient all-reduce bucket"),
}

# interval fields read only when their strategy is "steps": (strategy field, what it is)
INTERVALS = {
    "logging_steps": ("logging_strategy", "steps between logs (below 1: a fraction)"),
    "save_steps": ("save_strategy", "steps between checkpoints (below 1: a fraction)"),
    "eval_steps": ("eval_strategy", "steps between evaluations (below 1: a fraction)"),
}

# per-stage lists: (lower, lower included, upper, what each value is)
LISTS = {
    "activation_checkpoint_ratio": (0, True, 1, "the fraction of a stage's blocks recomputed"),
    "activation_memory_budget": (0, False, INF, "a stage's activation budget, MiB"),
}


def _bounds(low: float, low_in: bool, high: float, high_in: bool) -> str:
    if high == INF:
        return f"{'>=' if low_in else '>'} {low:g}" if low > -INF else "other than NaN"
    return f"in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def _check_integer(args, name: str) -> None:
    low, high, optional, what = INTEGERS[name]
    value = getattr(args, name)
    if value is None and optional:
        return
    wanted = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int) \
            or value < low or (high is not None and value > high):
        fix = "leave it unset (None) or " * optional + \
            f"set it to {low}{' or more' if high is None else f' .. {high}'}"
        raise ValueError(f"MerakArguments.{name}={value!r}: {what} must be {wanted}; {fix}")


def _real_error(name: str, value, rule: str, what: str) -> ValueError:
    return ValueError(f"MerakArguments.{name}={value!r}: {what} must be a number {rule}; set "
                      f"it to a number {rule}")


def _in(value, low: float, low_in: bool, high: float, high_in: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value):
        return False
    if value == INF and high == INF:
        return high_in
    return (value > low or (low_in and value == low)) \
        and (value < high or (high_in and value == high))


def _check_real(args, name: str) -> None:
    low, low_in, high, high_in, optional, what = REALS[name]
    value = getattr(args, name)
    if value is None and optional:
        return
    if not _in(value, low, low_in, high, high_in):
        raise _real_error(name, value, _bounds(low, low_in, high, high_in), what)


def check_ranges(args) -> None:
    """Every numeric field of `args` (a `MerakArguments`) within its range; raises `ValueError`
    naming the first field that is not, its value and the fix."""
    for name in INTEGERS:
        _check_integer(args, name)
    for name in REALS:
        _check_real(args, name)
    for name, (strategy, what) in INTERVALS.items():
        value = getattr(args, name)
        if value is not None and str(getattr(args, strategy)).lower().endswith("steps") \
                and not _in(value, 0, False, INF, False):
            raise _real_error(name, value, "> 0", what)
    for name, (low, low_in, high, what) in LISTS.items():
        for value in getattr(args, name) or ():
            if not _in(value, low, low_in, high, True):
                raise ValueError(f"MerakArguments.{name} holds {value!r}: {what} must be a "
                                 f"number {_bounds(low, low_in, high, True)}")
    if args.fp16 and args.loss_scale == 0 and args.min_loss_scale > 2 ** args.initial_scale_power:
        raise ValueError(f"MerakArguments.min_loss_scale={args.min_loss_scale} is above the "
                         f"initial dynamic scale 2 ** initial_scale_power = "
                         f"{2 ** args.initial_scale_power}; lower min_loss_scale or raise "
                         f"initial_scale_power")
