"""fp8 under tensor and context parallelism: Merak's column- and row-parallel linears, and
under cp the plain ones, as float8 linears whose every dynamic scale is the full tensor's
(`merak.engine.fp8` converts them).

A float8 linear casts six operands, each with a scale from its amax (the largest magnitude),
over the whole tensor (``tensorwise``) or along one axis (``rowwise``, torchao's "axiswise"):

=============================  =========  =============  ===================================
cast (torchao's name)          operand    rowwise amax   reduces over
=============================  =========  =============  ===================================
``input``                      x          per token      the in features
``weight``                     W^T        per out feat.  the in features
``grad_output``                dy         per token      the out features
``weight_for_grad_input``      W^T        per in feat.   the out features
``grad_output_for_grad_weight`` dy        per out feat.  the tokens
``input_for_grad_weight``      x          per in feat.   the tokens
=============================  =========  =============  ===================================

A TP rank holds a shard of some operands: a column-parallel layer splits the out features (its
W^T and dy are shards, x is whole on every rank), a row-parallel one the in features (its W^T
and x are shards, dy is whole). Where a cast's amax reduces over a split dimension (every
dimension, for ``tensorwise``), the rank's own amax is its shard's: the amax is then MAX
all-reduced over the TP group, so every rank scales by the full tensor's amax and casts its
elements exactly as one process would (`reduced_casts`). The max is exact, so the casts are the
single process's bit for bit; only the sums of the partial products differ, by float rounding.

Sequence parallelism changes none of this: the column-parallel layer's input is the whole
sequence, gathered before it, and the row-parallel layer's dy is gathered back by the
reduce-scatter's backward.

Context parallelism splits the tokens of x and dy (each rank holds a share of every row's
sequence): the casts whose amax runs over the tokens reduce it over the cp group, the same rule
with the tokens as the split dimension (``reduced_casts("cp", ...)``; a plain linear becomes
`Float8SequenceShardLinear`).

The matmul is torchao's `matmul_with_hp_or_float8_args` with that one change (the all-reduce
between the amax and the scale), made from torchao's own `tensor_to_amax`, `amax_to_scale` and
`hp_tensor_and_scale_to_float8`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from merak.tensor_parallel.layers.collectives import communicates
from merak.tensor_parallel.layers.megatron import (
    ColumnParallel,
    ColumnParallelLinear,
    RowParallel,
    RowParallelLinear,
)

# each cast: (config field suffix, operand, axiswise dim torchao reduces over)
CASTS = (("input", "x", -1), ("weight", "w", 0), ("grad_output", "dy", -1),
         ("weight_for_grad_input", "w", -1), ("grad_output_for_grad_weight", "dy", 0),
         ("input_for_grad_weight", "x", 0))
# the split dimension of each operand (x and dy as [tokens, features], W^T as [in, out]);
# absent: whole on every rank. "cp": context parallelism splits the tokens of x and dy
SPLIT = {"column": {"w": 1, "dy": 1}, "row": {"x": 1, "w": 0}, "cp": {"x": 0, "dy": 0}}


def reduced_casts(kind: str, config: Float8LinearConfig) -> tuple[str, ...]:
    """The casts of a `kind` (``column`` or ``row``) parallel float8 linear under `config`
    whose amax a TP rank must MAX all-reduce to get the full tensor's (module docstring);
    ``cp``: those a context-parallel rank, holding a share of the tokens, must."""
    found = []
    for name, operand, axis in CASTS:
        cast = getattr(config, f"cast_config_{name}")
        split = SPLIT[kind].get(operand)
        if split is None or cast.scaling_type is ScalingType.DISABLED:
            continue
        if cast.scaling_granularity is ScalingGranularity.TENSORWISE or axis % 2 == split:
            found.append(name)
    return tuple(found)


def _all_reduce_max(amax: torch.Tensor, group) -> torch.Tensor:
    """The max of `amax` over `group`, elementwise, in float32 (exact: the values are
    representable, the max rounds nothing; gloo has no bfloat16 MAX)."""
    out = amax.to(torch.float32).contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out.to(amax.dtype)


def _cast(t: torch.Tensor, config: Float8LinearConfig, name: str, axis: int, role,
          mm_config, groups):
    """torchao's `hp_tensor_to_float8_dynamic` of `t` by `config`'s `name` cast, the amax
    MAX all-reduced over each of `groups` first (tp, then cp)."""
    cast = getattr(config, f"cast_config_{name}")
    if tensor_already_casted_to_fp8(t) or cast.scaling_type is ScalingType.DISABLED:
        return t
    axis = axis if cast.scaling_granularity is ScalingGranularity.AXISWISE else None
    with torch.no_grad():
        amax = tensor_to_amax(t, scaling_granularity=cast.scaling_granularity,
                              axiswise_dim=axis)
        for group in groups:
            if communicates(group) and not t.is_meta:
                amax = _all_reduce_max(amax, group)
        scale = amax_to_scale(amax, cast.target_dtype, config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, mm_config, role, axis)


class _TPFloat8Matmul(torch.autograd.Function):
    """torchao's `matmul_with_hp_or_float8_args` (x @ W^T, its six casts), each cast's amax
    reduced over the groups `groups` gives it (none: the rank's own amax is the full one)."""

    @staticmethod
    def forward(ctx, x, weight_t, mm_config, config, groups):
        ctx.save_for_backward(x, weight_t)
        ctx.mm_config, ctx.config, ctx.groups = mm_config, config, groups
        x8 = _cast(x, config, "input", -1, GemmInputRole.INPUT, mm_config, groups["input"])
        w8 = _cast(weight_t, config, "weight", 0, GemmInputRole.WEIGHT, mm_config,
                   groups["weight"])
        shape = x8.shape
        out = torch.mm(x8.reshape(-1, shape[-1]), w8)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight_t = ctx.saved_tensors
        mm_config, config, groups = ctx.mm_config, ctx.config, ctx.groups
        shape = grad_output.shape
        dy = grad_output.reshape(-1, shape[-1])
        dy8 = _cast(dy, config, "grad_output", -1, GemmInputRole.GRAD_OUTPUT, mm_config,
                    groups["grad_output"])
        w8 = _cast(weight_t, config, "weight_for_grad_input", -1, GemmInputRole.WEIGHT,
                   mm_config, groups["weight_for_grad_input"])
        grad_input = torch.mm(dy8, w8.t())
        grad_input = grad_input.reshape(*shape[:-1], grad_input.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dy8 = _cast(dy, config, "grad_output_for_grad_weight", 0, GemmInputRole.GRAD_OUTPUT,
                    mm_config, groups["grad_output_for_grad_weight"])
        x8 = _cast(x2, config, "input_for_grad_weight", 0, GemmInputRole.INPUT, mm_config,
                   groups["input_for_grad_weight"])
        grad_weight = torch.mm(dy8.t(), x8)
        return grad_input, grad_weight.t(), None, None, None


class _Float8TP(Float8Linear):
    """A float8 linear whose casts reduce their amax over the TP group (and the cp group)
    where `reduced_casts` says (``fp8_tp_groups``, set by `to_float8_tp_`)."""

    fp8_tp_groups: dict = {}

    def _fp8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled():  # as torchao's forward does
            x = x.to(torch.get_autocast_gpu_dtype())
        return _TPFloat8Matmul.apply(x, self.weight.t(), self.linear_mm_config, self.config,
                                     self.fp8_tp_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._fp8_matmul(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class Float8ColumnParallelLinear(ColumnParallel, _Float8TP):
    """`ColumnParallelLinear` in float8 (its collectives, then `_Float8TP`'s forward)."""


class Float8RowParallelLinear(RowParallel, _Float8TP):
    """`RowParallelLinear` in float8: its partial product is the float8 matmul."""

    def _partial(self, x):
        return self._fp8_matmul(x)


class Float8SequenceShardLinear(_Float8TP):
    """A plain `nn.Linear` in float8 under context parallelism: its rank holds a share of the
    tokens, so the casts whose amax runs over tokens reduce it over the cp group."""


FLOAT8_CLASSES = {ColumnParallelLinear: (Float8ColumnParallelLinear, "column"),
                  RowParallelLinear: (Float8RowParallelLinear, "row"),
                  torch.nn.Linear: (Float8SequenceShardLinear, None)}


def to_float8_tp_(linear: torch.nn.Linear, config: Float8LinearConfig, convert,
                  cp_group=None) -> None:
    """`linear` (a `ColumnParallelLinear` or `RowParallelLinear`, or under cp a plain
    `nn.Linear`) becomes its float8 class in place: torchao's attributes added by `convert`
    (`merak.engine.fp8.to_float8_`, passed in so this module does not import its caller), its
    TP group on the casts `reduced_casts` lists, and `cp_group` (context parallelism: None
    without) on those it lists for ``cp``."""
    cls, kind = FLOAT8_CLASSES[type(linear)]
    tp = reduced_casts(kind, config) if kind is not None else ()
    cp = reduced_casts("cp", config) if cp_group is not None else ()
    tp_group = getattr(linear, "tp_group", None)
    convert(linear, config, Float8Linear, cls)
    linear.fp8_tp_groups = {name: tuple(g for g, on in ((tp_group, name in tp),
                                                         (cp_group, name in cp)) if on)
                            for name, _, _ in CASTS}
