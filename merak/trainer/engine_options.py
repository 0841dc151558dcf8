"""`MerakArguments.engine_options`: the `EngineOptions` the arguments describe for a layout.

The one place that reads argument names into the engine's options, one object per concern;
and the per-stage recomputation the engine starts with.
"""

from __future__ import annotations

import torch

from merak.engine.options import (
    CompileOptions,
    EngineOptions,
    HookOptions,
    LossScaling,
    PrecisionOptions,
)
from merak.partition.options import SplitOptions
from merak.runtime.options import RuntimeOptions
from merak.schedule.registry import SCHEDULES
from merak.tensor_parallel.plans.options import TensorParallelOptions


def engine_options_of(args, *, pp: int, dp: int = 1,
                      leaf_modules: tuple[str, ...] = ()) -> EngineOptions:
    """The options `MerakArguments` `args` describe for a job of `pp` pipeline ranks and `dp`
    data-parallel ranks (`leaf_modules`: the modules the split keeps opaque)."""
    chunks = SCHEDULES[args.train_schedule].stages_per_rank(args.num_model_chunks)
    scaling = LossScaling(args.loss_scale, args.initial_scale_power, args.loss_scale_window,
                          args.hysteresis, args.consecutive_hysteresis,
                          args.min_loss_scale) if args.fp16 else None
    return EngineOptions(
        split=SplitOptions(
            trace_method=args.trace_method, split_method=args.split_method,
            partition_method=args.partition_method, custom_partition=args.custom_partition,
            custom_split_points=args.custom_split_points, leaf_modules=leaf_modules,
            no_tie_modules=args.no_tie_modules),
        tensor_parallel=TensorParallelOptions(
            plan=args.tp_plan, parallel_vocab=args.parallel_vocab,
            sequence_parallel=args.sequence_parallel, sequence_dim=args.sequence_dim,
            overlap_level=args.tp_overlapping_level),
        pipeline=RuntimeOptions(
            schedule=args.train_schedule, num_microbatches=args.gradient_accumulation_steps,
            num_model_chunks=chunks, bucket_bytes=args.gradient_bucket_bytes,
            grad_predivide=dp if args.prescale_gradients
            else args.gradient_predivide_factor,
            recompute_ratio=initial_recompute_ratio(args, pp * chunks),
            segment_size=args.checkpoint_num_layers,
            recompute_in_backward=args.recompute_in_backward,
            dealloc_outputs=args.dealloc_pipeoutput),
        precision=PrecisionOptions(
            autocast_dtype=autocast_dtype(args.bf16, args.fp16), loss_scaling=scaling,
            zero_stage=args.zero_stage,
            zero_allow_untested_optimizer=args.zero_allow_untested_optimizer,
            fp8=args.fp8, fp8_exclude=tuple(args.fp8_exclude or ())),
        compile=CompileOptions(args.torch_compile, args.torch_compile_backend,
                               args.torch_compile_mode),
        hooks=HookOptions(args.max_grad_norm or 0.0, args.wall_clock_breakdown))


def autocast_dtype(bf16: bool, fp16: bool) -> torch.dtype | None:
    """The autocast dtype of HF's precision flags."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else None


def plans_recomputation(args, stages: int) -> bool:
    """Whether the recomputation of `args` is planned from a measurement once a batch exists
    (one activation_checkpoint_ratio, stage-aware, or activation_memory_budget)."""
    return args.plans_recomputation and stages > 1


def initial_recompute_ratio(args, stages: int) -> float | tuple[float, ...]:
    """The per-stage recompute ratio `MerakArguments` `args` start the engine with, for a
    split into `stages` stages: a planned recomputation starts at every block."""
    if not args.activation_checkpointing:
        return 0.0
    ratio = args.activation_checkpoint_ratio
    if plans_recomputation(args, stages) or ratio is None:
        return 1.0
    if len(ratio) == 1:
        return ratio[0]
    if len(ratio) != stages:
        raise ValueError(f"MerakArguments.activation_checkpoint_ratio has {len(ratio)} values for "
                         f"{stages} pipeline stages; give one per stage, or one for the first "
                         f"stage (stage-aware)")
    return tuple(ratio)
