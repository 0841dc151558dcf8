"""`EngineOptions`: everything `build_engine` needs besides the model, one frozen object made
of one options object per concern (the split, tensor parallelism, the pipeline runtime,
precision and ZeRO, `torch.compile`, hooks), each owned by the layer that reads it.

It is made once, from `MerakArguments` (`from_arguments`, by field name: the engine does not
import the trainer) or for a planner's candidate (`with_candidate`, over the options of the job
it plans for), so the trainer and the planner's dry runs build the same engine from the same
values. Hooks are options too: gradient clipping (`max_grad_norm`), fp16 loss scaling
(`loss_scaling`) and the wall-clock breakdown (`wall_clock_breakdown`) are built by the
assembly; hooks of higher layers (energy, NEFTune) are handed to `build_engine` as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from merak.partition.options import SplitOptions
from merak.rules import candidate_fields
from merak.runtime.options import RuntimeOptions
from merak.schedule.registry import SCHEDULES
from merak.tensor_parallel.plans.options import TensorParallelOptions


@dataclass(frozen=True)
class LossScaling:
    """fp16's dynamic (or static) loss scale (`merak.engine.loss_scale.LossScaler`)."""

    static_scale: float = 0.0
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0


@dataclass(frozen=True)
class PrecisionOptions:
    """Mixed precision and ZeRO: forwards under autocast to `autocast_dtype` (parameters stay
    fp32), fp16's `loss_scaling`, and the ZeRO stage (1: optimizer state sharded over dp; 2/3:
    FSDP2 gradients and parameters)."""

    autocast_dtype: torch.dtype | None = None
    loss_scaling: LossScaling | None = None
    zero_stage: int = 0
    zero_allow_untested_optimizer: bool = False


@dataclass(frozen=True)
class CompileOptions:
    """`torch.compile` of the stage's blocks (before recomputation wraps them)."""

    enabled: bool = False
    backend: str | None = None
    mode: str | None = None


@dataclass(frozen=True)
class HookOptions:
    """The instruction hooks the assembly builds besides fp16's loss scale: gradient clipping
    to `max_grad_norm` (0: none) and the wall-clock breakdown."""

    max_grad_norm: float = 0.0
    wall_clock_breakdown: bool = False


@dataclass(frozen=True)
class EngineOptions:
    """The options of one rank's engine, one object per concern, each passed whole to the
    part of the build that reads it: `split` to `merak.auto_split`, `tensor_parallel` to
    `merak.apply_tensor_parallel`, `pipeline` to the stage's build (schedule and chunks) and to
    `PipelineInterpreter`, `precision` to ZeRO, autocast and the loss scale, `compile` to
    `torch.compile`, `hooks` to the hooks the assembly builds."""

    split: SplitOptions = SplitOptions()
    tensor_parallel: TensorParallelOptions = TensorParallelOptions()
    pipeline: RuntimeOptions = RuntimeOptions()
    precision: PrecisionOptions = PrecisionOptions()
    compile: CompileOptions = CompileOptions()
    hooks: HookOptions = HookOptions()

    @classmethod
    def from_arguments(cls, args, *, pp: int, leaf_modules: tuple[str, ...] = (),
                       dp: int = 1) -> EngineOptions:
        """The options `MerakArguments` `args` describe for a job of `pp` pipeline ranks and
        `dp` data-parallel ranks (`leaf_modules`: the modules the split keeps opaque)."""
        chunks = SCHEDULES[args.train_schedule].stages_per_rank(args.num_model_chunks)
        scaling = LossScaling(args.loss_scale, args.initial_scale_power, args.loss_scale_window,
                              args.hysteresis, args.consecutive_hysteresis,
                              args.min_loss_scale) if args.fp16 else None
        return cls(
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
                zero_allow_untested_optimizer=args.zero_allow_untested_optimizer),
            compile=CompileOptions(args.torch_compile, args.torch_compile_backend,
                                   args.torch_compile_mode),
            hooks=HookOptions(args.max_grad_norm or 0.0, args.wall_clock_breakdown))

    @classmethod
    def for_dry_runs(cls, dtype: torch.dtype | None = None,
                     parallel_vocab: bool = False) -> EngineOptions:
        """The defaults, with forwards under autocast to `dtype` and `parallel_vocab`: the
        options a dry run builds when the job gives none."""
        return cls(tensor_parallel=TensorParallelOptions(parallel_vocab=parallel_vocab),
                   precision=PrecisionOptions(autocast_dtype=dtype))

    def with_candidate(self, candidate, recompute_ratios=None) -> EngineOptions:
        """These options with a strategy search candidate's choices (`rules.candidate_fields`:
        schedule, micro-batches, chunks, ZeRO stage, sequence parallelism and recomputation;
        `recompute_ratios`: the per-stage ratios of a ``budget`` candidate)."""
        if candidate.recompute == "budget" and recompute_ratios is None:
            raise ValueError(f"{candidate.label}: a budget recomputation needs its per-stage "
                             f"ratios (the prediction's recompute_ratios)")
        chosen = candidate_fields(candidate, recompute_ratios)
        in_backward = chosen["recompute_in_backward"]
        if "activation_checkpoint_ratio" in chosen:
            ratio = tuple(chosen["activation_checkpoint_ratio"])
        else:
            ratio = 1.0 if chosen["activation_checkpointing"] else 0.0
        pipeline = replace(self.pipeline, schedule=chosen["train_schedule"],
                           num_microbatches=chosen["gradient_accumulation_steps"],
                           num_model_chunks=candidate.chunks, recompute_ratio=ratio,
                           recompute_in_backward=in_backward,
                           segment_size=1 if in_backward else self.pipeline.segment_size)
        return replace(self, pipeline=pipeline,
                       precision=replace(self.precision, zero_stage=chosen["zero_stage"]),
                       tensor_parallel=replace(self.tensor_parallel,
                                               sequence_parallel=chosen["sequence_parallel"]))


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
