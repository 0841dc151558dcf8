"""`SplitOptions`: how `merak.auto_split` traces a model and cuts it into stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from merak.stages.assign import PARTITION_METHODS

TRACE_METHODS = ("export", "fx", "dynamo")
SPLIT_METHODS = ("farthest_min_deps", "nearest_min_deps", "layer_split")


def _tuple_or_none(values: Sequence | None) -> tuple | None:
    return tuple(values) if values is not None else None


@dataclass(frozen=True)
class SplitOptions:
    """The automatic split's options, checked when made.

    trace_method: ``export`` (torch.export, non-strict, dynamic sequence length), ``dynamo``
        (torch.export strict: TorchDynamo) or ``fx`` (torch.fx symbolic tracing, for
        fx-traceable custom models).
    split_method: where the non-block operations go: ``farthest_min_deps`` (next to their
        consumers), ``nearest_min_deps`` (next to their producers) or ``layer_split`` (with
        `custom_split_points`).
    partition_method: ``uniform``, ``uniform_floor``, ``parameters``, ``custom`` (with
        `custom_partition`) or ``profile``.
    custom_partition: the block indices where stages start, then the block count, e.g.
        ``(0, 4, 8)`` for two stages of 8 blocks (``custom``).
    custom_split_points: the blocks where a new stage begins (``layer_split``).
    leaf_modules: qualified names of modules kept opaque (called eagerly, never traced into).
    no_tie_modules: do not sum the gradients of weights shared across stages.
    """

    trace_method: str = "export"
    split_method: str = "farthest_min_deps"
    partition_method: str = "uniform"
    custom_partition: tuple[int, ...] | None = None
    custom_split_points: tuple[str, ...] | None = None
    leaf_modules: tuple[str, ...] = ()
    no_tie_modules: bool = False

    def __post_init__(self):
        if self.trace_method not in TRACE_METHODS:
            raise ValueError(f"unknown trace_method {self.trace_method!r}; choose one of "
                             f"{TRACE_METHODS}")
        if self.split_method not in SPLIT_METHODS:
            raise ValueError(f"unknown split_method {self.split_method!r}; choose one of "
                             f"{SPLIT_METHODS}")
        if self.partition_method not in PARTITION_METHODS:
            raise ValueError(f"unknown partition_method {self.partition_method!r}; choose one "
                             f"of {PARTITION_METHODS}")
        if self.split_method == "layer_split" and self.custom_split_points is None:
            raise ValueError("split_method='layer_split' needs custom_split_points: the module "
                             "names where a new stage begins")
        object.__setattr__(self, "custom_partition", _tuple_or_none(self.custom_partition))
        object.__setattr__(self, "custom_split_points", _tuple_or_none(self.custom_split_points))
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))
