"""A pipeline stage: the pieces one stage owns, under their original parameter names."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from merak.pipeline.split import PipelineSplit, ValueKey


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
