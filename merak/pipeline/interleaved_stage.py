"""The model chunks one rank hosts under an interleaved schedule, as one module.

With v chunks per rank the split has ``p * v`` virtual stages; rank r runs virtual stages
``r, r + p, ..., r + (v - 1) p``, one `PipelineStage` each. `InterleavedStage` holds them and
presents their pieces under the original parameter names (``model.layers.5.mlp...``), so the
optimizer, gradient clipping and checkpoints see one module, as with one stage per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from merak.distributed.parallel_context import ParallelContext
from merak.pipeline.split import PipelineSplit
from merak.pipeline.stage import PipelineStage


def chunk_stage_ids(num_ranks: int, num_chunks: int, pp_rank: int) -> list[int]:
    """The virtual stages rank `pp_rank` hosts, chunk by chunk: ``c * num_ranks + pp_rank``."""
    return [chunk * num_ranks + pp_rank for chunk in range(num_chunks)]


def _is_container(module: nn.Module) -> bool:
    return not module._parameters and not module._buffers and bool(module._modules)


def _merge(into: nn.Module, sources: Sequence[nn.Module], prefix: str) -> None:
    """Attach the children of `sources` under `into`: a module found under one name in one
    chunk only is shared as is; where chunks hold different containers under one name (each
    chunk's ``model``), a fresh container gathers their children (the chunks stay untouched)."""
    names = dict.fromkeys(n for s in sources for n, c in s._modules.items() if c is not None)
    for name in names:
        found = [s._modules[name] for s in sources if s._modules.get(name) is not None]
        children = list({id(c): c for c in found}.values())
        if len(children) == 1:
            into.add_module(name, children[0])
        elif all(_is_container(c) for c in children):
            box = nn.Module()
            into.add_module(name, box)
            _merge(box, children, f"{prefix}{name}.")
        elif any(True for c in children for _ in c.parameters()):
            raise ValueError(f"chunks hold different modules named {prefix}{name} with "
                             f"parameters; build the chunks from one split")
        else:  # parameter-free copies (rotary tables, graph helpers): one is enough here
            into.add_module(name, children[0])


class InterleavedStage(nn.Module):
    """The chunks (`PipelineStage`s) of one rank, with every piece under its original name.

    Args:
        chunks: the rank's stages in chunk order (virtual stages ``c * p + pp_rank``), all of
            one split. Parameters shared by two chunks (tied weights) must be one object
            (build the chunks from one container and materialize them together).

    Attributes:
        chunks: the `PipelineStage` of each chunk (what the interpreter runs).
        split: their common split (``split.num_stages`` = p * v virtual stages).
    """

    def __init__(self, chunks: Sequence[PipelineStage]):
        super().__init__()
        if not chunks:
            raise ValueError("an interleaved stage needs at least one chunk")
        split = chunks[0].split
        if any(c.split is not split for c in chunks):
            raise ValueError("the chunks come from different splits; build them from one")
        self.chunks = list(chunks)  # a plain list: the merged tree below registers the modules
        self.split = split
        _merge(self, chunks, "")

    @property
    def stage_ids(self) -> list[int]:
        return [c.stage_id for c in self.chunks]

    def forward(self, *args, **kwargs):
        raise TypeError("an InterleavedStage is run by InterleavedInterpreter, chunk by chunk")


def interleaved_stage(split: PipelineSplit, container: nn.Module, ctx: ParallelContext,
                      num_chunks: int) -> InterleavedStage:
    """This rank's chunks of `split` (``ctx.pp * num_chunks`` virtual stages) over `container`
    (the model, or an `AutoSplit`'s ``container``), not yet materialized."""
    if split.num_stages != ctx.pp * num_chunks:
        raise ValueError(f"the split has {split.num_stages} stages; interleaving {num_chunks} "
                         f"chunks over pp={ctx.pp} needs {ctx.pp * num_chunks}")
    return InterleavedStage([PipelineStage(container, split, s)
                             for s in chunk_stage_ids(ctx.pp, num_chunks, ctx.pp_rank)])
