"""`EngineOptions`: everything `build_engine` needs besides the model, one frozen object.

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

from merak.rules import candidate_fields
from merak.schedule.registry import SCHEDULES
from merak.tensor_parallel.plans.tp_plan import TPPlan


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
class EngineOptions:
    """The options of one rank's engine (stage, optimizer wrapping, interpreter, hooks)."""

    # the pipeline: schedule, micro-batches per step, model chunks per rank (interleaved)
    schedule: str = "1f1b"
    num_microbatches: int = 1
    num_model_chunks: int = 1
    # the automatic split (`merak.auto_split`'s options)
    trace_method: str = "export"
    split_method: str = "farthest_min_deps"
    partition_method: str = "uniform"
    custom_partition: tuple[int, ...] | None = None
    custom_split_points: tuple[str, ...] | None = None
    leaf_modules: tuple[str, ...] = ()
    no_tie_modules: bool = False
    # tensor parallelism (`merak.apply_tensor_parallel`)
    tp_plan: TPPlan | None = None
    parallel_vocab: bool = False
    sequence_parallel: bool = False
    sequence_dim: int = 1
    tp_overlapping_level: int = 0
    # precision: forwards under autocast to this dtype (parameters stay fp32)
    autocast_dtype: torch.dtype | None = None
    # data parallelism and ZeRO
    zero_stage: int = 0
    zero_allow_untested_optimizer: bool = False
    bucket_bytes: int = 25 * 2**20
    grad_predivide: float = 1.0
    # recomputation: per-stage ratios (or one for all) and blocks per segment
    recompute_ratio: float | tuple[float, ...] = 0.0
    segment_size: int = 1
    recompute_in_backward: bool = False  # one block at a time, inside the backward
    # runtime
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    dealloc_outputs: bool = False
    measure_activations: bool = False
    # hooks the assembly builds
    max_grad_norm: float = 0.0
    loss_scaling: LossScaling | None = None
    wall_clock_breakdown: bool = False

    @property
    def chunks(self) -> int:
        """Model chunks per rank: the schedule's (2 for ``zbv`` and ``dualpipev``;
        `num_model_chunks` for interleaved 1F1B; else 1)."""
        return SCHEDULES[self.schedule].stages_per_rank(self.num_model_chunks)

    @classmethod
    def from_arguments(cls, args, *, pp: int, leaf_modules: tuple[str, ...] = (),
                       dp: int = 1) -> EngineOptions:
        """The options `MerakArguments` `args` describe for a job of `pp` pipeline ranks and
        `dp` data-parallel ranks (`leaf_modules`: the modules the split keeps opaque)."""
        chunks = SCHEDULES[args.train_schedule].stages_per_rank(args.num_model_chunks)
        scaling = LossScaling(args.loss_scale, args.initial_scale_power, args.loss_scale_window,
                              args.hysteresis, args.consecutive_hysteresis,
                              args.min_loss_scale) if args.fp16 else None
        tuple_or_none = lambda v: tuple(v) if v is not None else None
        return cls(
            schedule=args.train_schedule, num_microbatches=args.gradient_accumulation_steps,
            num_model_chunks=chunks, trace_method=args.trace_method,
            split_method=args.split_method, partition_method=args.partition_method,
            custom_partition=tuple_or_none(args.custom_partition),
            custom_split_points=tuple_or_none(args.custom_split_points),
            leaf_modules=tuple(leaf_modules), no_tie_modules=args.no_tie_modules,
            tp_plan=args.tp_plan, parallel_vocab=args.parallel_vocab,
            sequence_parallel=args.sequence_parallel, sequence_dim=args.sequence_dim,
            tp_overlapping_level=args.tp_overlapping_level,
            autocast_dtype=autocast_dtype(args.bf16, args.fp16),
            zero_stage=args.zero_stage,
            zero_allow_untested_optimizer=args.zero_allow_untested_optimizer,
            bucket_bytes=args.gradient_bucket_bytes,
            grad_predivide=dp if args.prescale_gradients else args.gradient_predivide_factor,
            recompute_ratio=initial_recompute_ratio(args, pp * chunks),
            segment_size=args.checkpoint_num_layers,
            recompute_in_backward=args.recompute_in_backward,
            torch_compile=args.torch_compile,
            torch_compile_backend=args.torch_compile_backend,
            torch_compile_mode=args.torch_compile_mode,
            dealloc_outputs=args.dealloc_pipeoutput, max_grad_norm=args.max_grad_norm or 0.0,
            loss_scaling=scaling, wall_clock_breakdown=args.wall_clock_breakdown)

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
        return replace(self, schedule=chosen["train_schedule"],
                       num_microbatches=chosen["gradient_accumulation_steps"],
                       num_model_chunks=candidate.chunks, zero_stage=chosen["zero_stage"],
                       sequence_parallel=chosen["sequence_parallel"], recompute_ratio=ratio,
                       recompute_in_backward=in_backward,
                       segment_size=1 if in_backward else self.segment_size)


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
