"""`build_engine`: the one assembly of a rank's training engine, in one documented order.

    parallelize (TP -> split -> materialize or load this rank's stage; with ep > 1 each MoE
    layer keeps this rank's experts, `merak.expert_parallel`, cut before a checkpoint's load)
    -> fp8: the stage's linears as torchao float8 linears (`merak.engine.fp8`)
    -> torch.compile of the blocks (before recomputation wraps them)
    -> ZeRO-2/3 (FSDP2, before anything holds the parameters)
    -> optimizer over the stage -> ZeRO-1 (its state sharded over dp)
    -> hooks (fp16 loss scale, gradient clipping, wall-clock timers, then the caller's)
    -> `PipelineInterpreter`

`MerakTrainer`, the planner's dry runs, `merak coverage` and the benches all build through
here, from an `EngineOptions`: the planner measures the engine the trainer runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from merak import rules
from merak.data_parallel.zero import ZeroSharding, check_optimizer, shard_stage
from merak.data_parallel.zero1 import zero1
from merak.distributed.parallel_context import ParallelContext
from merak.distributed.timeouts import set_job_timeout
from merak.engine.compile import compile_blocks
from merak.engine.fp8 import Float8Report, Float8WeightScales, apply_fp8, gathers_in_float8
from merak.engine.grad_norm import GradNormClipper
from merak.engine.loss_scale import LossScaler
from merak.engine.options import EngineOptions
from merak.engine.parallelize import parallelize
from merak.engine.timers import WallClockBreakdown
from merak.runtime.hooks import InstructionHook
from merak.runtime.interpreter import PipelineInterpreter
from merak.stages.stage import InterleavedStage, PipelineStage

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass
class Engine:
    """What `build_engine` made for this rank: the stage (its model chunks), the optimizer as
    the step uses it (ZeRO-1 wrapped), the interpreter, and the hooks it built."""

    stage: PipelineStage | InterleavedStage
    optimizer: torch.optim.Optimizer
    interpreter: PipelineInterpreter
    zero: ZeroSharding | None
    clipper: GradNormClipper
    scaler: LossScaler | None
    timers: WallClockBreakdown | None
    fp8: Float8Report | None = None


def default_optimizer(stage: nn.Module) -> torch.optim.Optimizer:
    """AdamW at lr 1e-4 over the stage: what a dry run steps when the job gives none. One
    parameter group per device mesh (ZeRO-2/3 with ep shards the experts over another mesh
    than the rest, and a foreach kernel cannot span two meshes), as HF's `create_optimizer`
    groups them."""
    groups: dict = {}
    for param in stage.parameters():
        groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return torch.optim.AdamW([{"params": params} for params in groups.values()], lr=1e-4)


def build_engine(model: nn.Module, example: dict[str, torch.Tensor], ctx: ParallelContext,
                 options: EngineOptions, *,
                 make_optimizer: OptimizerFactory = default_optimizer,
                 checkpoint: str | Path | None = None, checkpoint_prefix: str = "",
                 tp_rng: object = None,
                 stage_hooks: Callable[[nn.Module], Sequence[InstructionHook]] | None = None,
                 hooks: Sequence[InstructionHook] = ()) -> Engine:
    """Build this rank's engine for `model` (ideally meta-built) from one micro-batch
    `example`, in the order of this module's docstring.

    Args:
        make_optimizer: builds the optimizer over the stage (HF's `create_optimizer` for the
            trainer); ZeRO-1 then wraps it when ``options.precision.zero_stage == 1``.
        checkpoint, checkpoint_prefix: see `merak.parallelize` (default: the directory of a
            model built by ``from_pretrained``).
        tp_rng: the model's `TPRandomState` (recomputation replays it).
        stage_hooks: called with the built stage, returns hooks that need it (NEFTune's noise
            on the stage's embedding); they run after the assembly's own hooks.
        hooks: more hooks, run last (the energy plan's clock hook).
    """
    o = options
    rules.check(o.choices(ctx), owner="EngineOptions")  # before anything is built
    stage = parallelize(model, example, ctx, tensor_parallel=o.tensor_parallel, split=o.split,
                        schedule=o.pipeline.schedule, num_model_chunks=o.pipeline.chunks,
                        checkpoint=checkpoint, checkpoint_prefix=checkpoint_prefix,
                        autocast_dtype=o.precision.autocast_dtype)
    fp8 = apply_fp8(stage, o.precision, ctx)  # the stage's own linears, before anything holds them
    if o.compile.enabled:  # before the interpreter wraps the blocks for recomputation
        compile_blocks(stage, o.compile.backend, o.compile.mode)
    precision = o.precision
    param_dtype = torch.bfloat16 if precision.autocast_dtype == torch.bfloat16 else None
    zero = shard_stage(stage, ctx, precision.zero_stage, param_dtype=param_dtype) \
        if precision.zero_stage >= 2 else None
    optimizer = make_optimizer(stage)
    if precision.zero_stage == 1:
        optimizer = zero1(optimizer, ctx)
    if zero is not None:
        check_optimizer(optimizer, precision.zero_allow_untested_optimizer)
    scaler = LossScaler(ctx, **vars(precision.loss_scaling)) \
        if precision.loss_scaling is not None else None
    clipper = GradNormClipper(stage, ctx, o.hooks.max_grad_norm)
    timers = WallClockBreakdown(ctx.device) if o.hooks.wall_clock_breakdown else None
    built = [h for h in (scaler, clipper, timers) if h is not None]  # unscale before clipping
    if zero is not None and gathers_in_float8(precision, ctx):
        built.append(Float8WeightScales(stage))  # after the step: the next gathers' scales
    later = list(stage_hooks(stage)) if stage_hooks is not None else []
    interpreter = PipelineInterpreter(stage, ctx, optimizer, o.pipeline,
                                      autocast_dtype=precision.autocast_dtype,
                                      hooks=[*built, *later, *hooks], tp_rng=tp_rng, zero=zero)
    if scaler is not None:
        scaler.bind(interpreter)
    set_job_timeout()  # the groups made here (tied weights, ZeRO) wait at most the job's timeout
    return Engine(stage, optimizer, interpreter, zero, clipper, scaler, timers, fp8)
