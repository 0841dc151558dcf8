"""Merak: automatic 3D parallelism (data x tensor x pipeline) for PyTorch and HF models."""

from merak.build import parallelize
from merak.distributed.parallel_context import ParallelContext, get_context, init
from merak.partition.auto import AutoSplit, auto_split
from merak.partition.checkpoint import load_safetensors_
from merak.partition.meta import init_empty_weights, materialize_
from merak.pipeline.actions import Action, ActionKind, Schedule
from merak.pipeline.hooks import InstructionHook
from merak.pipeline.interleaved import InterleavedSchedule, interleaved_1f1b
from merak.pipeline.interleaved_runtime import InterleavedInterpreter
from merak.pipeline.interleaved_stage import InterleavedStage
from merak.pipeline.interpreter import PipelineInterpreter
from merak.pipeline.p2p import P2PTimeoutError
from merak.pipeline.schedules import SCHEDULES, make_schedule
from merak.pipeline.simulator import CostModel, ScheduleError, SimulationResult, simulate
from merak.pipeline.split import Piece, PipelineSplit, TiedWeight, manual_split
from merak.pipeline.stage import PipelineStage
from merak.pipeline.timeline import TimelineRecorder
from merak.pipeline.validate import validate_schedule
from merak.tensor_parallel.apply import apply_tensor_parallel
from merak.tensor_parallel.layers import vocab_parallel_cross_entropy
from merak.tensor_parallel.plans import TPPlan, set_tp_layer_lists
from merak.trainer.arguments import MerakArguments, NotSupportedYetError
from merak.trainer.trainer import MerakTrainer

__version__ = "0.1.0"

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "AutoSplit",
    "CostModel",
    "InstructionHook",
    "InterleavedInterpreter",
    "InterleavedSchedule",
    "InterleavedStage",
    "MerakArguments",
    "MerakTrainer",
    "NotSupportedYetError",
    "P2PTimeoutError",
    "ParallelContext",
    "Piece",
    "PipelineInterpreter",
    "PipelineSplit",
    "PipelineStage",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "TPPlan",
    "TiedWeight",
    "TimelineRecorder",
    "apply_tensor_parallel",
    "auto_split",
    "get_context",
    "init",
    "init_empty_weights",
    "interleaved_1f1b",
    "load_safetensors_",
    "make_schedule",
    "manual_split",
    "materialize_",
    "parallelize",
    "set_tp_layer_lists",
    "simulate",
    "validate_schedule",
    "vocab_parallel_cross_entropy",
]
