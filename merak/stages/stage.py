"""Pipeline stages: the pieces one stage owns, under their original parameter names; and the
model chunks (stages) one rank hosts under an interleaved or V-shaped schedule, as one module.

With v model chunks per rank the split has ``p * v`` stages; the schedule's placement says
which a rank runs (round-robin: rank r runs ``r, r + p, ..., r + (v - 1) p``; a V: r and
``2p - 1 - r``), one `PipelineStage` each. `InterleavedStage` holds them, with the placement it
was built for, and presents their pieces under the original parameter names
(``model.layers.5.mlp...``), so the optimizer, gradient clipping and checkpoints see one
module, as with one stage per rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import fx, nn

from merak.schedule.actions import Placement, round_robin, stages_of
from merak.stages.split import PipelineSplit, ValueKey


def _attach(root: nn.Module, qualified_name: str, module: nn.Module) -> None:
    """Place `module` at `qualified_name` under `root`, creating empty containers on the way, so
    parameter names stay those of the original model (checkpoints keep loading)."""
    *parents, leaf = qualified_name.split(".")
    node = root
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]
    node.add_module(leaf, module)


def _outputs_of(result: object, names: tuple[str, ...], module_name: str) -> list[torch.Tensor]:
    if isinstance(result, Mapping):
        missing = [n for n in names if n not in result]
        if missing:
            raise ValueError(f"piece {module_name!r} returned keys {list(result)} but the split "
                             f"expects outputs {list(names)} (missing {missing})")
        return [result[n] for n in names]
    if isinstance(result, (tuple, list)):
        if len(result) != len(names):
            raise ValueError(f"piece {module_name!r} returned {len(result)} values but the split "
                             f"names {len(names)} outputs {list(names)}")
        return list(result)
    if len(names) != 1:
        raise ValueError(f"piece {module_name!r} returned one value but the split names "
                         f"{len(names)} outputs {list(names)}")
    return [result]


def block_names(split: PipelineSplit, stage_id: int) -> list[str]:
    """The module names of the blocks stage `stage_id` runs, in order: the repeated blocks an
    automatic split found (``model.layers.3``), or the pieces of a manual split."""
    found = getattr(split, "blocks_of_stage", None)
    if found:
        return list(found[stage_id])
    return [split.pieces[i].module for i in split.piece_ids(stage_id)
            if not split.pieces[i].flat]


class PipelineStage(nn.Module):
    """Runs the pieces of one stage on a dict of values keyed by `ValueKey`."""

    def __init__(self, model: nn.Module, split: PipelineSplit, stage_id: int):
        super().__init__()
        if not 0 <= stage_id < split.num_stages:
            raise ValueError(f"stage_id {stage_id} is outside 0..{split.num_stages - 1}")
        self.stage_id = stage_id
        self.split = split
        self.piece_ids = split.piece_ids(stage_id)
        self._piece_names = [split.pieces[i].module for i in self.piece_ids]
        self._flat: dict[str, nn.Module] = {}  # flat pieces: called directly, not registered
        for piece in dict.fromkeys(split.pieces[i] for i in self.piece_ids):
            module = model.get_submodule(piece.module)
            if piece.flat:
                self._flat[piece.module] = module
                for child_name, child in module.named_children():
                    if child_name in self._modules and self._modules[child_name] is not child:
                        raise ValueError(f"flat pieces of stage {stage_id} both define "
                                         f"{child_name!r}; give each stage one flat piece")
                    self.add_module(child_name, child)
                if module._parameters:  # constants (buffers) may stay at its root
                    raise ValueError(f"flat piece {piece.module!r} holds parameters at its root "
                                     f"({list(module._parameters)}); nest them in a submodule")
            elif piece.module == "":
                raise ValueError("a piece cannot be the whole model (module name '')")
            else:
                _attach(self, piece.module, module)

    def forward(self, values: dict[ValueKey, torch.Tensor]) -> dict[ValueKey, torch.Tensor]:
        """Run every piece in order; returns `values` extended with everything produced."""
        values = dict(values)
        for piece_id, name in zip(self.piece_ids, self._piece_names):
            args = [values[key] for key in self.split.input_keys(piece_id)]
            module = self._flat.get(name) or self.get_submodule(name)
            result = module(*args)
            outputs = _outputs_of(result, self.split.pieces[piece_id].outputs, name)
            values.update(zip(self.split.output_keys(piece_id), outputs))
        return values

    def freeable_outputs(self) -> frozenset[ValueKey]:
        """The values this stage sends that nothing else on it reads, so their data may be
        freed once sent (``dealloc_pipeoutput``): a piece's graph (an `fx.GraphModule`, as
        the automatic split makes) computes each and uses it only as an output, and no later
        piece of the stage reads it. Autograd may have saved a value that another operation
        of the stage reads, and freeing it would corrupt that backward; a plain module's
        insides are unknown, so its outputs are never listed (with a warning)."""
        sent = {k for keys in self.split.send_plan(self.stage_id).values() for k in keys}
        read = {k for i in self.piece_ids for k in self.split.input_keys(i)}
        found, opaque = set(), []
        for piece_id, name in zip(self.piece_ids, self._piece_names):
            keys = [k for k in self.split.output_keys(piece_id) if k in sent and k not in read]
            module = self._flat.get(name) or self.get_submodule(name)
            if keys and not isinstance(module, fx.GraphModule):
                opaque.append(name)
                continue
            out = next((n for n in module.graph.nodes if n.op == "output"), None) if keys \
                else None
            produced = out.args[0] if out is not None else None
            for key in keys if isinstance(produced, dict) else ():
                node = produced.get(key[0])
                if isinstance(node, fx.Node) and node.op not in ("placeholder", "get_attr") \
                        and set(node.users) == {out}:
                    found.add(key)
        if opaque:
            warnings.warn(f"dealloc_pipeoutput: stage {self.stage_id} keeps what pieces "
                          f"{opaque} send (plain modules: whether they read their outputs "
                          f"again is unknown); an automatic split's stage graphs show it",
                          stacklevel=2)
        return frozenset(found)


def _is_container(module: nn.Module) -> bool:
    return not module._parameters and not module._buffers and bool(module._modules)


def _same_tensors(modules: Sequence[nn.Module]) -> bool:
    """Whether `modules` hold the very same parameters and buffers under the same names (one
    tied weight, which two chunks' pieces each reach through a module of their own)."""
    def tensors(m: nn.Module) -> list[tuple[str, int]]:
        return [(n, id(t)) for n, t in (*m.named_parameters(remove_duplicate=False),
                                        *m.named_buffers(remove_duplicate=False))]
    return all(tensors(m) == tensors(modules[0]) for m in modules[1:])


def _merge(into: nn.Module, sources: Sequence[nn.Module], prefix: str) -> None:
    """Attach the children of `sources` under `into`: a module found under one name in one
    chunk only is shared as is; where chunks hold different containers under one name (each
    chunk's ``model``), a fresh container gathers their children (the chunks stay untouched).
    Where they hold different modules of the same tensors (a V puts GPT-2's embedding, stage 0,
    and its tied head, the last stage, on rank 0), the later chunks take the first one's
    module, so the rank holds one parameter that materializing and loading replace once."""
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
        elif _same_tensors(children):
            for source in sources:
                if source._modules.get(name) is not None:
                    source._modules[name] = children[0]
            into.add_module(name, children[0])
        elif any(True for c in children for _ in c.parameters()):
            raise ValueError(f"chunks hold different modules named {prefix}{name} with "
                             f"parameters; build the chunks from one split")
        else:  # parameter-free copies (rotary tables, graph helpers): one is enough here
            into.add_module(name, children[0])


class InterleavedStage(nn.Module):
    """The chunks (`PipelineStage`s) of one rank, with every piece under its original name.

    Args:
        chunks: the rank's stages in model order, all of one split. Parameters shared by two
            chunks (tied weights) must be one object (build the chunks from one container and
            materialize them together).
        placement: the pipeline rank of every stage of the split, as the schedule places them
            (`merak.schedule.registry.placement_of`); None: not recorded (the interpreter
            then takes its schedule's).

    Attributes:
        chunks: the `PipelineStage` of each chunk (what the interpreter runs).
        split: their common split (``split.num_stages`` = p * v virtual stages).
        placement: as given.
    """

    def __init__(self, chunks: Sequence[PipelineStage], placement: Placement | None = None):
        super().__init__()
        self.placement = tuple(placement) if placement is not None else None
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

    @property
    def stages(self) -> list[PipelineStage]:
        return self.chunks

    def forward(self, *args, **kwargs):
        raise TypeError("an InterleavedStage is run by PipelineInterpreter, "
                        "one model chunk at a time")


def interleaved_stage(split: PipelineSplit, container: nn.Module, ctx, num_chunks: int,
                      placement: Placement | None = None) -> InterleavedStage:
    """This rank's chunks of `split` (``ctx.pp * num_chunks`` virtual stages) over `container`
    (the model, or an `AutoSplit`'s ``container``), not yet materialized: the stages
    `placement` puts on this rank (default round-robin)."""
    if split.num_stages != ctx.pp * num_chunks:
        raise ValueError(f"the split has {split.num_stages} stages; interleaving {num_chunks} "
                         f"chunks over pp={ctx.pp} needs {ctx.pp * num_chunks}")
    placement = tuple(placement or round_robin(ctx.pp, num_chunks))
    return InterleavedStage([PipelineStage(container, split, s)
                             for s in stages_of(placement, ctx.pp_rank)], placement)


def stage_placement(stage: nn.Module, num_ranks: int) -> Placement:
    """The pipeline rank of every stage of `stage`'s split: the placement an `InterleavedStage`
    was built for, else round-robin."""
    placement = getattr(stage, "placement", None)
    return placement or round_robin(num_ranks, stage.split.num_stages // num_ranks)
