"""`EngineOptions`: everything `build_engine` needs besides the model, one frozen object made
of one options object per concern (the split, tensor parallelism, the pipeline runtime,
precision and ZeRO, `torch.compile`, hooks), each owned by the layer that reads it.

`MerakArguments` makes them (`MerakArguments.engine_options`, in the trainer's layer: the
engine knows no argument names), a dry run gives a strategy search candidate's choices over
the options of the job it plans for (`with_candidate`), so the trainer and the dry runs build
the same engine from the same values. Hooks are options too: gradient clipping
(`max_grad_norm`), fp16 loss scaling (`loss_scaling`) and the wall-clock breakdown
(`wall_clock_breakdown`) are built by the assembly; hooks of higher layers (energy, NEFTune)
are handed to `build_engine` as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from merak.partition.options import SplitOptions
from merak.rules import Choices, candidate_fields
from merak.runtime.options import RuntimeOptions
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
    fp32), fp16's `loss_scaling`, the ZeRO stage (1: optimizer state sharded over dp; 2/3:
    FSDP2 gradients and parameters), and fp8: the stage's linears as torchao float8 linears
    with the `fp8` recipe (``tensorwise`` or ``rowwise``), but for the modules matching an
    `fp8_exclude` pattern and those `merak.engine.fp8` keeps in high precision."""

    autocast_dtype: torch.dtype | None = None
    loss_scaling: LossScaling | None = None
    zero_stage: int = 0
    zero_allow_untested_optimizer: bool = False
    fp8: str | None = None
    fp8_exclude: tuple[str, ...] = ()


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
    def for_dry_runs(cls, dtype: torch.dtype | None = None,
                     parallel_vocab: bool = False) -> EngineOptions:
        """The defaults, with forwards under autocast to `dtype` and `parallel_vocab`: the
        options a dry run builds when the job gives none."""
        return cls(tensor_parallel=TensorParallelOptions(parallel_vocab=parallel_vocab),
                   precision=PrecisionOptions(autocast_dtype=dtype))

    def choices(self, ctx) -> Choices:
        """The values `merak.rules` reads, as these options and the layout of `ctx` (a
        `ParallelContext`) set them: `build_engine` checks the same rules as `MerakArguments`
        on what it is given. What the options do not hold (adapters, generation, a planned
        layout) is left at the rules' defaults; a schedule given as a `Schedule` object
        rather than a registered name is checked by the interpreter that runs it."""
        p, tp, precision = self.pipeline, self.tensor_parallel, self.precision
        ratio = p.recompute_ratio
        recomputes = any(r > 0 for r in ratio) if isinstance(ratio, tuple) else ratio > 0
        return Choices(
            train_schedule=p.schedule if isinstance(p.schedule, str) else p.schedule.name,
            zero_stage=precision.zero_stage, activation_checkpointing=recomputes,
            sequence_parallel=tp.sequence_parallel, torch_compile=self.compile.enabled,
            divides_gradients=p.grad_predivide != 1.0, tp_overlapping_level=tp.overlap_level,
            fp8=precision.fp8, fp16=precision.autocast_dtype == torch.float16,
            cp=ctx.cp, tp=ctx.tp, ep=ctx.ep)

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
