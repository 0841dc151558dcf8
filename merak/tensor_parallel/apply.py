"""Apply a tensor-parallel plan to a (meta-built) model, in place, before it is split.

Build order (issue 4): meta model -> `apply_tensor_parallel` -> `auto_split` -> materialize own
stage -> dp. The converted modules keep their names, so each rank materializes or loads exactly
its shard (`ShardSpec`), and the pipeline split keeps the TP modules that live outside the
repeated blocks (embedding, LM head) as opaque eager calls.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from merak.distributed.parallel_context import ParallelContext, get_context
from merak.partition.graph_rewrite import find_blocks, within
from merak.tensor_parallel import layers
from merak.tensor_parallel.overlap import check_overlap_args, set_tp_overlap
from merak.tensor_parallel.plans import (DIVISIBLE_CONFIG_ATTRS, TPPlan, as_tp_plan, matches,
                                         plan_for)
from merak.tensor_parallel.rng import install_tp_rng
from merak.tensor_parallel.sequence import enable_sequence_parallel


@dataclass(frozen=True)
class TPInfo:
    """What `apply_tensor_parallel` did, kept on the model as ``model.merak_tp``."""

    size: int
    rank: int
    plan: TPPlan
    converted: tuple[str, ...]
    parallel_vocab: bool
    sequence_parallel: bool


def _check_divisible(model: nn.Module, tp: int, parallel_vocab: bool) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    names = DIVISIBLE_CONFIG_ATTRS + (("vocab_size",) if parallel_vocab else ())
    for attr in names:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(f"tp={tp} must divide {attr}, but {type(config).__name__}.{attr} = "
                             f"{value}; choose a tp that divides it"
                             + ("" if attr != "vocab_size" else " or parallel_vocab=False"))


def _divide_attr(module: nn.Module, name: str, attr: str, tp: int) -> None:
    value = getattr(module, attr)
    if not isinstance(value, int) or value % tp:
        raise ValueError(f"tp={tp} must divide {name}.{attr} = {value!r}")
    setattr(module, attr, value // tp)


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext | None = None, *,
                          plan: TPPlan | Mapping | None = None, parallel_vocab: bool = False,
                          sequence_parallel: bool = False, sequence_dim: int = 1,
                          overlap_level: int = 0, overlap_sub_batches: int = 2) -> nn.Module:
    """Shard `model` for this rank's place in the TP group of `ctx` (default: `merak.init`'s).

    The plan is `plan` when given (a `TPPlan`, or a dict of `merak.set_tp_layer_lists`'
    arguments), else the one `set_tp_layer_lists` recorded for the job (``ctx.tp_plan``), else
    the family's, else the config's ``base_model_tp_plan`` (`plans.plan_for`).

    `overlap_level` and `overlap_sub_batches` (sub-pipelined TP, ``tp_overlapping_level``) are
    passed to `merak.tensor_parallel.overlap.set_tp_overlap` once the model is converted.

    Raises:
        ValueError: tp does not divide a head count or size (the error names the attribute), the
            model has no plan (the error names `merak.set_tp_layer_lists`), `plan` is invalid,
            sequence parallelism is asked for a family whose plan does not support it, or the
            overlap arguments are invalid (level not 0-2, overlap_sub_batches < 2, with
            sequence parallelism or tp=1); checked before the model is touched.
    """
    check_overlap_args(overlap_level, overlap_sub_batches, sequence_parallel=sequence_parallel)
    plan = as_tp_plan(plan)
    ctx = ctx or get_context()
    if getattr(model, "merak_tp", None) is not None:
        raise ValueError("this model is already tensor-parallel")
    tp, rank, group = ctx.tp, ctx.tp_rank, ctx.tp_group
    if tp == 1:
        if sequence_parallel:
            raise ValueError("sequence_parallel splits the sequence across tensor-parallel "
                             "ranks and needs tp > 1; set sequence_parallel=False")
        if overlap_level:
            raise ValueError("overlap_level overlaps tensor-parallel all-reduces and needs "
                             "tp > 1; set overlap_level=0")
        return model  # parallel_vocab over one rank is the plain vocabulary
    plan = plan_for(model, ctx, plan)
    _check_divisible(model, tp, parallel_vocab)
    config = getattr(model, "config", None)
    reason = plan.unsupported(config) if plan.unsupported else None
    if reason:
        raise ValueError(reason)
    if sequence_parallel and plan.sp_gather is None:
        raise ValueError(f"sequence_parallel is not supported yet for {type(model).__name__} "
                         f"(its TP plan has no sp_gather modules); set sequence_parallel=False")
    blocks = find_blocks(model)
    in_block = (lambda n: any(within(n, b) for b in blocks)) if blocks else (lambda n: True)
    named = [(n, m) for n, m in model.named_modules() if in_block(n)]
    cache: dict = {}  # id(original parameter) -> its shard: tied weights stay tied
    converted = _convert_linears(named, plan, config, group, rank, tp, cache,
                                 sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
    converted += _divide_and_shard_heads(named, plan, rank, tp, cache)
    if parallel_vocab:
        converted += _split_vocabulary(model, plan, group, rank, tp, cache)
    _mark_partial_grads(model, plan, sequence_parallel, in_block)
    tp_modules = {name: m for name, m in named if name in converted}
    install_tp_rng(model, [m for m in tp_modules.values() if isinstance(m, layers.ColumnParallel)],
                   [m for m in tp_modules.values() if isinstance(m, layers.RowParallel)],
                   [model.get_submodule(b) for b in blocks], rank, sequence_parallel)
    if sequence_parallel:
        enable_sequence_parallel(model, blocks, plan.sp_gather, group, sequence_dim)
    model.merak_tp = TPInfo(tp, rank, plan, tuple(converted), parallel_vocab, sequence_parallel)
    if overlap_level:
        set_tp_overlap(model, overlap_level, overlap_sub_batches)
    return model


def _convert_linears(named, plan: TPPlan, config, group, rank: int, tp: int, cache: dict,
                     **sp) -> list[str]:
    converted = []
    for name, module in named:
        style = plan.style(name, module)
        if style == "column":
            chunks = next((f(config) for p, f in plan.fused.items() if matches(name, p)), None)
            layers.make_column_parallel_(module, name, group, rank, tp, chunks=chunks,
                                         cache=cache, **sp)
        elif style == "row":
            layers.make_row_parallel_(module, name, group, rank, tp, cache=cache, **sp)
        else:
            continue
        converted.append(name)
    if not converted:
        raise ValueError(f"the TP plan ({plan.source}) matched no module; check its patterns "
                         f"against model.named_modules()")
    return converted


def _divide_and_shard_heads(named, plan: TPPlan, rank: int, tp: int, cache: dict) -> list[str]:
    """Per-rank head counts in attributes (and private configs); per-head parameters split."""
    sharded = []
    for name, module in named:
        for pattern, attrs in plan.divide.items():
            if matches(name, pattern):
                for attr in attrs:
                    _divide_attr(module, name, attr, tp)
        for pattern, attrs in plan.own_config.items():
            if matches(name, pattern):
                module.config = copy.copy(module.config)
                for attr in attrs:
                    _divide_attr(module.config, f"{name}.config", attr, tp)
        for attr in plan.divide_anywhere:
            if hasattr(module, attr):
                _divide_attr(module, name, attr, tp)
        for param_name, param in list(module.named_parameters(recurse=False)):
            full = f"{name}.{param_name}"
            dim = next((d for p, d in plan.head_sharded.items() if matches(full, p)), None)
            if dim is not None:
                setattr(module, param_name,
                        layers.shard_parameter(param, dim, rank, tp, cache=cache))
                sharded.append(full)
    return sharded


def _split_vocabulary(model: nn.Module, plan: TPPlan, group, rank: int, tp: int,
                      cache: dict) -> list[str]:
    """Vocab-parallel embedding; the LM head column-parallel with its logits gathered (so the
    model's own loss works), sharing the embedding's shard when the two are tied."""
    converted = []
    for name, module in model.named_modules():
        if any(matches(name, p) for p in plan.embeddings):
            layers.make_vocab_parallel_(module, name, group, rank, tp, cache=cache)
        elif any(matches(name, p) for p in plan.lm_head):
            layers.make_column_parallel_(module, name, group, rank, tp, gather_output=True,
                                         cache=cache)
        else:
            continue
        converted.append(name)
    if not converted:
        raise ValueError(f"parallel_vocab found none of {[*plan.embeddings, *plan.lm_head]} in "
                         f"{type(model).__name__}; set parallel_vocab=False")
    return converted


def _mark_partial_grads(model: nn.Module, plan: TPPlan, sequence_parallel: bool,
                        in_block) -> None:
    """Flag replicated parameters whose gradient is a per-rank part (``tp_partial_grad``): the
    pipeline interpreter sums those over the TP group before the optimizer step."""
    for name, param in model.named_parameters():
        if getattr(param, "tp_shard", None) is not None:
            continue
        module_name = name.rsplit(".", 1)[0]
        if any(matches(module_name, p) for p in plan.partial_grad) or (
                sequence_parallel and in_block(name)):
            param.tp_partial_grad = True
