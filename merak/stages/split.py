"""The stage split as data: which pieces each stage owns and which named values cross stages.

A *piece* is a submodule of the model called with named values and producing named values. The
model's data flow is the sequence of pieces; a value name rebound by a later piece (``h`` out of
every block) is versioned internally, so each consumer reads the newest binding before it. A
value read by a piece but produced by none is a *batch input* (``input_ids``, ``labels``) and is
loaded only by the stages that read it. A value produced on stage a and read on stage b > a is
sent a -> b directly, even when b > a + 1 (skip connections).

`manual_split` builds the object from a user-given list; the automatic partitioner produces the
same object.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from merak.stages import assign

ValueKey = tuple[str, int]  # (name, index of the producing piece); -1 marks a batch input


@dataclass(frozen=True)
class Piece:
    """A submodule (`module`, a qualified name in the model) with its named inputs/outputs.

    The module is called as ``module(*[values[n] for n in inputs])`` and returns one tensor for
    a single output, or a tuple/list/dict (HF ModelOutput included) holding every output name.
    A `flat` piece (a stage graph of `auto_split`) lends its children to the stage root, so its
    parameters keep the names they have inside it (the original model's names).
    """

    module: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flat: bool = False

    def __init__(self, module: str, inputs: Sequence[str], outputs: Sequence[str],
                 flat: bool = False):
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "inputs", tuple(inputs))
        object.__setattr__(self, "outputs", tuple(outputs))
        object.__setattr__(self, "flat", flat)


@dataclass(frozen=True)
class TiedWeight:
    """One parameter shared by pieces of several stages: its qualified name on each stage."""

    names: tuple[tuple[int, str], ...]  # (stage_id, parameter name in that stage's module)

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(stage for stage, _ in self.names)


@dataclass(frozen=True)
class PipelineSplit:
    """Pieces in execution order and the stage each belongs to (non-decreasing, 0..P-1)."""

    pieces: tuple[Piece, ...]
    stage_of_piece: tuple[int, ...]
    output: str = "loss"
    tied_weights: tuple[TiedWeight, ...] = ()

    def __post_init__(self) -> None:
        if not self.pieces:
            raise ValueError("a pipeline split needs at least one piece")
        if len(self.stage_of_piece) != len(self.pieces):
            raise ValueError(f"stage_of_piece has {len(self.stage_of_piece)} entries for "
                             f"{len(self.pieces)} pieces")
        stages = list(self.stage_of_piece)
        if stages[0] != 0 or any(b - a not in (0, 1) for a, b in itertools.pairwise(stages)):
            raise ValueError(f"stages must be contiguous and start at 0 (every stage owning at "
                             f"least one piece), got stage_of_piece={stages}")
        if self.output not in self.pieces[-1].outputs:
            raise ValueError(f"the last piece ({self.pieces[-1].module}) must output "
                             f"{self.output!r}; it outputs {list(self.pieces[-1].outputs)}")
        self._bindings  # resolve names now so errors surface at construction  # noqa: B018

    @property
    def num_stages(self) -> int:
        return self.stage_of_piece[-1] + 1

    def piece_ids(self, stage_id: int) -> list[int]:
        return [i for i, s in enumerate(self.stage_of_piece) if s == stage_id]

    def stage_pieces(self, stage_id: int) -> list[Piece]:
        return [self.pieces[i] for i in self.piece_ids(stage_id)]

    @functools.cached_property
    def _bindings(self) -> list[list[ValueKey]]:
        """For each piece, the value key each of its inputs reads."""
        latest: dict[str, int] = {}
        bindings = []
        for index, piece in enumerate(self.pieces):
            bindings.append([(name, latest.get(name, -1)) for name in piece.inputs])
            for name in piece.outputs:
                latest[name] = index
        return bindings

    def input_keys(self, piece_id: int) -> list[ValueKey]:
        return self._bindings[piece_id]

    def output_keys(self, piece_id: int) -> list[ValueKey]:
        return [(name, piece_id) for name in self.pieces[piece_id].outputs]

    @property
    def output_key(self) -> ValueKey:
        return (self.output, len(self.pieces) - 1)

    def batch_inputs(self, stage_id: int) -> list[str]:
        """Batch keys (model inputs) the pieces of `stage_id` read: only these are loaded."""
        names = []
        for i in self.piece_ids(stage_id):
            names += [n for n, producer in self._bindings[i] if producer < 0 and n not in names]
        return names

    @functools.cached_property
    def transfers(self) -> dict[tuple[int, int], list[ValueKey]]:
        """``(src_stage, dst_stage) -> value keys`` sent between them, in a fixed order."""
        result: dict[tuple[int, int], list[ValueKey]] = {}
        for i, keys in enumerate(self._bindings):
            dst = self.stage_of_piece[i]
            for key in keys:
                if key[1] >= 0 and self.stage_of_piece[key[1]] != dst:
                    sent = result.setdefault((self.stage_of_piece[key[1]], dst), [])
                    if key not in sent:
                        sent.append(key)
        return dict(sorted(result.items()))

    @property
    def edges(self) -> frozenset[tuple[int, int]]:
        return frozenset(self.transfers)

    def recv_plan(self, stage_id: int) -> dict[int, list[ValueKey]]:
        return {src: keys for (src, dst), keys in self.transfers.items() if dst == stage_id}

    def send_plan(self, stage_id: int) -> dict[int, list[ValueKey]]:
        return {dst: keys for (src, dst), keys in self.transfers.items() if src == stage_id}

    def describe(self) -> str:
        lines = []
        for s in range(self.num_stages):
            lines.append(f"stage {s}: {', '.join(p.module for p in self.stage_pieces(s))}")
            if self.batch_inputs(s):
                lines.append(f"  loads   {', '.join(self.batch_inputs(s))}")
            for src, keys in self.recv_plan(s).items():
                lines.append(f"  from {src}  {', '.join(n for n, _ in keys)}")
        for tied in self.tied_weights:
            lines.append("tied: " + " = ".join(f"stage {s}:{n}" for s, n in tied.names))
        return "\n".join(lines)


def _stage_of_piece(num_pieces: int, num_stages: int | None,
                    pieces_per_stage: Sequence[int] | None) -> list[int]:
    if (num_stages is None) == (pieces_per_stage is None):
        raise ValueError("give exactly one of num_stages (split pieces evenly) or "
                         "pieces_per_stage")
    if pieces_per_stage is None:
        return assign.uniform(num_pieces, num_stages, num_before=0, num_after=0)
    if sum(pieces_per_stage) != num_pieces or any(n < 1 for n in pieces_per_stage):
        raise ValueError(f"pieces_per_stage={list(pieces_per_stage)} must be positive and sum "
                         f"to the number of pieces, {num_pieces}")
    return [s for s, n in enumerate(pieces_per_stage) for _ in range(n)]


def find_tied_weights(model: nn.Module, pieces: Sequence[Piece],
                      stage_of_piece: Sequence[int]) -> tuple[TiedWeight, ...]:
    """Parameters that the pieces of more than one stage share (e.g. embedding and LM head)."""
    owners: dict[int, dict[int, str]] = {}
    for piece, stage in zip(pieces, stage_of_piece):
        module = model.get_submodule(piece.module)
        for local, param in module.named_parameters(remove_duplicate=False):
            name = local if piece.flat or not piece.module else f"{piece.module}.{local}"
            owners.setdefault(id(param), {}).setdefault(stage, name)
    return tuple(TiedWeight(tuple(sorted(by_stage.items())))
                 for by_stage in owners.values() if len(by_stage) > 1)


def manual_split(model: nn.Module, pieces: Sequence[Piece], *, num_stages: int | None = None,
                 pieces_per_stage: Sequence[int] | None = None, output: str = "loss",
                 tie_weights: bool = True) -> PipelineSplit:
    """Split `model` into consecutive stages from a user-given list of pieces.

    Args:
        model: the full model; every `Piece.module` must name one of its submodules.
        pieces: the model's data flow in execution order.
        num_stages: split the pieces as evenly as possible into this many stages, or
        pieces_per_stage: the number of pieces of each stage.
        output: the name of the scalar loss the last piece produces.
        tie_weights: detect parameters shared across stages and reduce their gradients.
    """
    names = {name for name, _ in model.named_modules()}
    missing = [p.module for p in pieces if p.module not in names]
    if missing:
        raise ValueError(f"pieces name modules the model does not have: {missing}; valid names "
                         f"are those of model.named_modules()")
    stage_of_piece = _stage_of_piece(len(pieces), num_stages, pieces_per_stage)
    tied = find_tied_weights(model, pieces, stage_of_piece) if tie_weights else ()
    return PipelineSplit(tuple(pieces), tuple(stage_of_piece), output, tied)
