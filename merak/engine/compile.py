"""`torch_compile` for `MerakTrainer`: each local stage's blocks (the repeated transformer
layers) compiled with `torch.compile`, in place.

HF's Trainer compiles the whole model (``torch.compile(model)``, whose `state_dict` keys gain
``_orig_mod.``). A Merak stage is an fx graph whose blocks are the model's own eager modules, so
only their ``forward`` is replaced, per block instance, by its compiled version: module names,
parameters and `state_dict` keys stay those of the model (checkpoints keep loading), the glue
between the blocks (embedding, final norm, LM head, loss, tensor-parallel modules outside the
blocks) stays eager, and Merak's recomputation (`merak.recompute.blocks`) wraps the compiled
forward like the eager one: it reruns the same compiled block under the same RNG state and
collects the tensors the compiled graph saves for backward (its saved-tensor hooks are plain
functions, so dynamo does not guard on them and the rerun does not recompile). Blocks of one
class share their compiled graphs (the parameters are graph inputs).
"""

from __future__ import annotations

import torch
from torch import nn

from merak.stages.stage import InterleavedStage, PipelineStage, block_names

# torch.compile modes a pipeline stage can take. "reduce-overhead" and "max-autotune" capture
# CUDA graphs, which replay from static buffers: a stage keeps several micro-batches' forwards
# alive at once (1F1B, GPipe) and recomputation reruns a block's forward, so a later replay
# would overwrite the outputs an earlier micro-batch still needs for its backward.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_mode(mode: str | None) -> None:
    """Refuse a `torch_compile_mode` a pipeline stage cannot run (see `COMPILE_MODES`), when
    the arguments are made: before any process group or model is built."""
    if mode is None or mode in COMPILE_MODES:
        return
    why = ("it captures CUDA graphs, whose replays reuse static output buffers: several live "
           "micro-batches (1F1B, GPipe) and recomputation's reruns of a block would overwrite "
           "outputs a pending backward still needs" if mode in CUDA_GRAPH_MODES
           else "torch.compile has no such mode")
    raise ValueError(f"MerakArguments.torch_compile_mode={mode!r} is not supported ({why}); "
                     f"use one of {list(COMPILE_MODES)}")


def compile_blocks(stage: PipelineStage | InterleavedStage, backend: str | None = "inductor",
                   mode: str | None = None) -> list[str]:
    """Compile the forward of every block of this rank's stage(s); returns the blocks' names.

    Call it before the interpreter installs recomputation (it wraps whatever forward the block
    has then).
    """
    stages = stage.stages if isinstance(stage, InterleavedStage) else [stage]
    names = []
    for s in stages:
        for name in block_names(s.split, s.stage_id):
            block: nn.Module = s.get_submodule(name)
            if "forward" in block.__dict__:
                raise RuntimeError(f"block {name!r} already has its own forward (compiled twice, "
                                   f"or wrapped by recomputation); compile the blocks before "
                                   f"building the PipelineInterpreter")
            block.forward = torch.compile(block.forward, backend=backend or "inductor",
                                          mode=mode)
            names.append(name)
    return names
