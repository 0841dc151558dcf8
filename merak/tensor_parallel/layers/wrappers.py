"""Tensor-parallel conversions of modules that are not plain linear layers (transformers' plan
styles `moe_tp_experts` / `all_reduce`, `moe_identity_expert`, `mla_kv_a_proj`,
`embedding_colwise`; see `merak.tensor_parallel.plans.hf_styles`), and block inputs sliced per rank
(inferred plans' `split_inputs`).

As in `merak.tensor_parallel.layers.megatron`, a module is converted in place by swapping its class
for a subclass that adds the collectives around the original forward, so its parameters keep their
names and every reference to it sees the change.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from merak.tensor_parallel.layers.collectives import (
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)
from merak.tensor_parallel.layers.megatron import _TPMixin, shard_parameter

_SUBCLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    key = (mixin, cls)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    module.__class__ = _SUBCLASSES[key]


def _copy_in(value, group):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return copy_to_tp(value, group)
    return value


class PartialSum(_TPMixin):
    """A module whose parameters are split so that each rank computes a part of the output
    (the experts on their slices of the intermediate dim): floating inputs are replicated and
    enter with an all-reduce in backward; the output (or the first element of a tuple) is
    summed over the TP ranks."""

    def forward(self, *args, **kwargs):
        group = self.tp_group
        args = tuple(_copy_in(a, group) for a in args)
        kwargs = {k: _copy_in(v, group) for k, v in kwargs.items()}
        out = super().forward(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return reduce_from_tp(out, group)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (reduce_from_tp(out[0], group),) + out[1:]
        raise TypeError(f"{type(self).__name__} returned {type(out).__name__}: a "
                        f"moe_tp_experts / all_reduce module must return a tensor")


class ScaledIdentity(_TPMixin):
    """An identity expert inside a `PartialSum` module: input divided by tp, so the sum over
    the ranks counts it once."""

    tp_size: int = 1

    def forward(self, x, *args, **kwargs):
        return super().forward(x / self.tp_size, *args, **kwargs)


class RopeGradReduce(_TPMixin):
    """MLA's replicated ``kv_a_proj_with_mqa``: its last `rope_dim` output features (the shared
    rotary key) go straight to this rank's heads, so their gradient is summed over TP; the
    other features go through a column-parallel layer, which sums theirs already."""

    rope_dim: int = 0

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        width = out.shape[-1]
        kept, rope = out.split([width - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([kept, copy_to_tp(rope, self.tp_group)], dim=-1)


class EmbeddingDimParallel(_TPMixin, nn.Embedding):
    """Embedding split along its features: each rank looks up its slice of every vector and the
    slices are all-gathered."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        return gather_from_tp(out, -1, self.tp_group)


def make_partial_sum_(module: nn.Module, name: str, group, owned: set[str]) -> None:
    """Convert `module` (the experts). `owned` names its parameters that are split; any other
    parameter directly in it would be counted tp times, so it is refused."""
    stray = [n for n, p in module.named_parameters(recurse=False) if n not in owned
             and getattr(p, "tp_shard", None) is None]
    if stray:
        raise ValueError(f"{name} is summed over tensor-parallel ranks (moe_tp_experts / "
                         f"all_reduce) but its parameter(s) {stray} are not split by the plan: "
                         f"each rank would add them, tp times in all. Give them a plan entry "
                         f"(merak.set_tp_layer_lists / MerakArguments(tp_plan=...)) or use tp=1")
    _swap_class(module, PartialSum)
    module.tp_group = group


def make_scaled_identity_(module: nn.Module, group, size: int) -> None:
    _swap_class(module, ScaledIdentity)
    module.tp_group, module.tp_size = group, size


def make_rope_grad_reduce_(module: nn.Module, name: str, group, config) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "qk_rope_head_dim", None)
    if not isinstance(rope, int):
        raise ValueError(f"{name} is mla_kv_a_proj, which needs the config's qk_rope_head_dim; "
                         f"{type(config).__name__} has none. Give a plan with "
                         f"merak.set_tp_layer_lists(...) or use tp=1")
    _swap_class(module, RopeGradReduce)
    module.tp_group, module.rope_dim = group, rope


def make_embedding_dim_parallel_(module: nn.Module, name: str, group, rank: int, size: int,
                                 cache: dict | None = None) -> None:
    if type(module) is not nn.Embedding:
        raise TypeError(f"{name} is a {type(module).__name__}, not an nn.Embedding: it cannot be "
                        f"split along its features (embedding_colwise)")
    module.weight = shard_parameter(module.weight, 1, rank, size, cache=cache)
    module.__class__ = EmbeddingDimParallel
    module.embedding_dim //= size
    module.tp_group = group


def take_periods(x: torch.Tensor, dim: int, period: int, group, rank: int,
                 size: int) -> torch.Tensor:
    """This rank's ``period // size`` elements of each `period` along `dim` (backward:
    all-gathered, so what computed `x` gets the whole gradient)."""
    pos = period // size
    parts = x.unflatten(dim, (x.shape[dim] // period, size, pos))
    if group is None:  # no process group (a shape check): the slice alone
        mine = parts.narrow(dim + 1, rank, 1)
    else:
        mine = scatter_to_tp(parts, dim + 1, group)
    return mine.flatten(dim, dim + 2)


class SplitInputs:
    """A block whose inputs are sliced per rank first (`split_inputs_`), inside its forward: a
    trace of the model that keeps the block's call whole keeps the slicing inside it."""

    split_entries: dict = {}  # path -> (dim, period)
    tp_group = None
    tp_rank, tp_size = 0, 1

    def _fix(self, prefix: str, value):
        leaves, spec = pytree.tree_flatten_with_path(value)
        new = []
        for path, leaf in leaves:
            where = self.split_entries.get(prefix + pytree.keystr(path))
            if where is not None and isinstance(leaf, torch.Tensor):
                leaf = take_periods(leaf, *where, self.tp_group, self.tp_rank, self.tp_size)
            new.append(leaf)
        return pytree.tree_unflatten(new, spec)

    def forward(self, *args, **kwargs):
        plain = super().forward
        bound = inspect.signature(plain).bind(*args, **kwargs)
        for name, value in list(bound.arguments.items()):  # named as `trace.named_inputs` does
            kind = bound.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                bound.arguments[name] = {k: self._fix(f"[{k!r}]", v) for k, v in value.items()}
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                bound.arguments[name] = self._fix(f"[{name!r}]", value)
        return plain(*bound.args, **bound.kwargs)


def split_inputs_(module: nn.Module, entries, group, rank: int, size: int) -> None:
    """Slice `module`'s inputs per rank before it runs: `entries` are (path among its named
    inputs (`merak.tensor_parallel.tracing.trace.named_inputs`), dim, period) triples (see
    `take_periods`), e.g. ALiBi biases of every head sliced to this rank's heads."""
    _swap_class(module, SplitInputs)
    module.split_entries = {path: (dim, period) for path, dim, period in entries}
    module.tp_group, module.tp_rank, module.tp_size = group, rank, size
