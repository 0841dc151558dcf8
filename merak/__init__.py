"""Merak: automatic 3D parallelism (data x tensor x pipeline) for PyTorch and HF models."""

from merak.distributed.liveness import PeerFailureError
from merak.distributed.parallel_context import ParallelContext, get_context
from merak.engine.parallelize import parallelize
from merak.generation import generate
from merak.materialize.meta import init_empty_weights, materialize_
from merak.materialize.safetensors import load_safetensors_
from merak.partition.auto import AutoSplit, auto_split
from merak.runtime.hooks import InstructionHook, TimelineRecorder
from merak.runtime.interpreter import PipelineInterpreter
from merak.runtime.p2p import P2PTimeoutError
from merak.schedule.actions import Action, ActionKind, Schedule
from merak.schedule.errors import ScheduleError
from merak.schedule.registry import SCHEDULES, ScheduleInfo, make_schedule
from merak.schedule.simulator import CostModel, SimulationResult, simulate
from merak.schedule.validate import validate_schedule
from merak.stages.split import Piece, PipelineSplit, TiedWeight, manual_split
from merak.stages.stage import InterleavedStage, PipelineStage
from merak.strategy.init import init
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
    "InterleavedStage",
    "MerakArguments",
    "MerakTrainer",
    "NotSupportedYetError",
    "P2PTimeoutError",
    "ParallelContext",
    "PeerFailureError",
    "Piece",
    "PipelineInterpreter",
    "PipelineSplit",
    "PipelineStage",
    "Schedule",
    "ScheduleError",
    "ScheduleInfo",
    "SimulationResult",
    "TPPlan",
    "TiedWeight",
    "TimelineRecorder",
    "apply_tensor_parallel",
    "auto_split",
    "generate",
    "get_context",
    "init",
    "init_empty_weights",
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
