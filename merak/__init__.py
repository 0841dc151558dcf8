"""Merak: automatic parallelism (data x tensor x pipeline x context, ZeRO) for PyTorch and HF
models.

The public names load on first use (PEP 562): ``import merak`` itself imports nothing of the
training stack, so a script pays only for what it uses, and a helper process (the background
clock planner, ``python -m merak.energy``) starts without torch's distributed stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "Action": "merak.schedule.actions",
    "ActionKind": "merak.schedule.actions",
    "AutoSplit": "merak.partition.auto",
    "CostModel": "merak.schedule.simulator",
    "InstructionHook": "merak.runtime.hooks",
    "InterleavedStage": "merak.stages.stage",
    "MerakArguments": "merak.trainer.arguments",
    "MerakTrainer": "merak.trainer.trainer",
    "NotSupportedYetError": "merak.trainer.arguments",
    "P2PTimeoutError": "merak.runtime.p2p",
    "ParallelContext": "merak.distributed.parallel_context",
    "PeerFailureError": "merak.distributed.liveness",
    "Piece": "merak.stages.split",
    "PipelineInterpreter": "merak.runtime.interpreter",
    "PipelineSplit": "merak.stages.split",
    "PipelineStage": "merak.stages.stage",
    "RuntimeOptions": "merak.runtime.options",
    "SCHEDULES": "merak.schedule.registry",
    "Schedule": "merak.schedule.actions",
    "ScheduleError": "merak.schedule.errors",
    "ScheduleInfo": "merak.schedule.registry",
    "SimulationResult": "merak.schedule.simulator",
    "SplitOptions": "merak.partition.options",
    "TPPlan": "merak.tensor_parallel.plans.tp_plan",
    "TensorParallelOptions": "merak.tensor_parallel.plans.options",
    "TiedWeight": "merak.stages.split",
    "TimelineRecorder": "merak.runtime.hooks",
    "apply_tensor_parallel": "merak.tensor_parallel.apply.apply",
    "auto_split": "merak.partition.auto",
    "generate": "merak.generation",
    "get_context": "merak.distributed.parallel_context",
    "init": "merak.strategy.init",
    "init_empty_weights": "merak.materialize.meta",
    "load_safetensors_": "merak.materialize.safetensors",
    "make_schedule": "merak.schedule.registry",
    "manual_split": "merak.stages.split",
    "materialize_": "merak.materialize.meta",
    "parallelize": "merak.engine.parallelize",
    "set_tp_layer_lists": "merak.tensor_parallel.plans.tp_plan",
    "simulate": "merak.schedule.simulator",
    "validate_schedule": "merak.schedule.validate",
    "vocab_parallel_cross_entropy": "merak.tensor_parallel.layers.megatron",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'merak' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (later lookups skip this function)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from merak.distributed.liveness import PeerFailureError  # noqa: F401
    from merak.distributed.parallel_context import ParallelContext, get_context  # noqa: F401
    from merak.engine.parallelize import parallelize  # noqa: F401
    from merak.generation import generate  # noqa: F401
    from merak.materialize.meta import init_empty_weights, materialize_  # noqa: F401
    from merak.materialize.safetensors import load_safetensors_  # noqa: F401
    from merak.partition.auto import AutoSplit, auto_split  # noqa: F401
    from merak.partition.options import SplitOptions  # noqa: F401
    from merak.runtime.hooks import InstructionHook, TimelineRecorder  # noqa: F401
    from merak.runtime.interpreter import PipelineInterpreter  # noqa: F401
    from merak.runtime.options import RuntimeOptions  # noqa: F401
    from merak.runtime.p2p import P2PTimeoutError  # noqa: F401
    from merak.schedule.actions import Action, ActionKind, Schedule  # noqa: F401
    from merak.schedule.errors import ScheduleError  # noqa: F401
    from merak.schedule.registry import SCHEDULES, ScheduleInfo, make_schedule  # noqa: F401
    from merak.schedule.simulator import CostModel, SimulationResult, simulate  # noqa: F401
    from merak.schedule.validate import validate_schedule  # noqa: F401
    from merak.stages.split import Piece, PipelineSplit, TiedWeight, manual_split  # noqa: F401
    from merak.stages.stage import InterleavedStage, PipelineStage  # noqa: F401
    from merak.strategy.init import init  # noqa: F401
    from merak.tensor_parallel.apply.apply import apply_tensor_parallel  # noqa: F401
    from merak.tensor_parallel.layers.megatron import vocab_parallel_cross_entropy  # noqa: F401
    from merak.tensor_parallel.plans.options import TensorParallelOptions  # noqa: F401
    from merak.tensor_parallel.plans.tp_plan import TPPlan, set_tp_layer_lists  # noqa: F401
    from merak.trainer.arguments import MerakArguments, NotSupportedYetError  # noqa: F401
    from merak.trainer.trainer import MerakTrainer  # noqa: F401
