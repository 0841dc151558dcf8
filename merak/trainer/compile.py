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

from merak.runtime.stage import InterleavedStage, PipelineStage, block_names


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
