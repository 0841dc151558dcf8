"""Convert a model's modules by a tensor-parallel plan, in place: the sharding itself, once the
plan is chosen and checked (`merak.tensor_parallel.apply.apply.apply_tensor_parallel` chooses it;
`merak.tensor_parallel.apply.infer` tries a candidate plan on a meta copy with it).

The converted modules keep their names, so each rank materializes or loads exactly its shard
(`ShardSpec`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from merak import lora
from merak.stages.blocks import find_blocks, within
from merak.tensor_parallel.layers import lora_adapters, megatron, wrappers
from merak.tensor_parallel.layers.rng import install_tp_rng
from merak.tensor_parallel.layers.sequence import enable_sequence_parallel, whole_modules
from merak.tensor_parallel.overlap.levels import set_tp_overlap
from merak.tensor_parallel.plans.hf_styles import STYLE_MEANINGS
from merak.tensor_parallel.plans.tp_plan import HEAD_ATTRS, TPPlan, matches
from merak.tensor_parallel.tracing import proof


@dataclass(frozen=True)
class TPInfo:
    """What `apply_tensor_parallel` did, kept on the model as ``model.merak_tp``."""

    size: int
    rank: int
    plan: TPPlan
    converted: tuple[str, ...]
    parallel_vocab: bool
    sequence_parallel: bool
    styles: Mapping[str, str] = field(default_factory=dict)  # converted name -> its TP style
    # for a plan to prove before use (``plan.check``): each block structure's unsharded copy and
    # inputs (`merak.tensor_parallel.tracing.proof.collect`), which `merak.parallelize` proves it
    # with
    examples: tuple = ()

    def style_of(self, name: str) -> str:
        """How the converted module or parameter `name` is split, and by which plan."""
        return f"{self.styles.get(name, 'tensor-parallel')} (plan: {self.plan.source})"


def _divide_attr(module: nn.Module, name: str, attr: str, tp: int) -> None:
    value = getattr(module, attr)
    if not isinstance(value, int) or value % tp:
        raise ValueError(f"tp={tp} must divide {name}.{attr} = {value!r}")
    setattr(module, attr, value // tp)


def convert(model: nn.Module, ctx, plan: TPPlan, *, parallel_vocab: bool = False,
            sequence_parallel: bool = False, sequence_dim: int = 1, overlap_level: int = 0,
            overlap_sub_batches: int = 2) -> nn.Module:
    """Shard `model` by `plan` (chosen and checked: `plan_refusal` found nothing) for this
    rank's place in the TP group of `ctx` (``tp`` > 1, ``tp_rank``, ``tp_group``, ``device``);
    sets ``model.merak_tp`` (`TPInfo`). The arguments are `apply_tensor_parallel`'s.

    Raises:
        ValueError: sequence parallelism for a plan without ``sp_gather``, LoRA adapters with
            sequence parallelism or overlap, a head count tp does not divide, or a plan that
            matched no module.
    """
    tp, rank, group = ctx.tp, ctx.tp_rank, ctx.tp_group
    config = getattr(model, "config", None)
    if sequence_parallel and plan.sp_gather is None:
        raise ValueError(f"sequence_parallel is not supported yet for {type(model).__name__} "
                         f"(its TP plan, {plan.source}, has no sp_gather modules: a transformers "
                         f"plan needs its family's attention and MLP names in SEQUENCE_PARALLEL "
                         f"of merak/tensor_parallel/plans/hf_styles.py and a parity run; an "
                         f"inferred plan has none); set sequence_parallel=False")
    blocks = find_blocks(model)
    examples = tuple(proof.collect(model, blocks, getattr(ctx, "device", "cpu"))) \
        if plan.check and blocks else ()
    in_block = (lambda n: any(within(n, b) for b in blocks)) if blocks else (lambda n: True)
    lora_names = {n for n, m in model.named_modules() if lora.is_lora_layer(m)}
    if lora_names and (sequence_parallel or overlap_level):
        raise ValueError("LoRA adapters under tensor parallelism work without sequence "
                         "parallelism and TP overlap; set sequence_parallel=False and "
                         "tp_overlapping_level=0")
    # a LoRA layer is converted whole (its base layer by the plan, its adapters to match)
    named = [(n, m) for n, m in model.named_modules()
             if in_block(n) and not lora.inside_lora(n, lora_names)]
    cache: dict = {}  # id(original parameter) -> its shard: tied weights stay tied
    styles: dict[str, str] = {}
    converted = _convert_linears(named, plan, config, group, rank, tp, cache, styles,
                                 sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
    lora_adapters.check_tp_targets(named, set(converted))
    converted += _divide_and_shard_heads(named, plan, rank, tp, cache, styles)
    converted += _convert_other_styles(named, plan, config, group, rank, tp, cache, styles)
    if not converted:
        raise ValueError(f"the TP plan ({plan.source}) matched no module; check its patterns "
                         f"against model.named_modules()")
    for name in blocks:
        entries = [e for p, es in plan.split_inputs.items() if matches(name, p) for e in es]
        if entries:
            wrappers.split_inputs_(model.get_submodule(name), entries, group, rank, tp)
            converted.append(name)
            styles[name] = "inputs " + ", ".join(path for path, _, _ in entries) + \
                " sliced per rank"
    if parallel_vocab:
        converted += _split_vocabulary(model, plan, group, rank, tp, cache)
    # sequence parallelism runs the blocks' MoE layers whole on every rank (see `sequence`), and
    # modules whose split is gathered back inside them (OLMoE's attention) or that are not split
    whole = tuple(whole_modules(model, blocks, plan.sp_gather,
                                {n for n in converted if _any(n, plan.partial_sum)
                                 or _any(n, plan.gather_output)},
                                set(converted))) if sequence_parallel else ()
    for name in whole:  # (e.g. DeepSeek-V3's shared experts) all-reduce on the full sequences
        for module in model.get_submodule(name).modules():
            if megatron.is_tensor_parallel(module):
                module.sequence_parallel = False
    _mark_partial_grads(model, plan, sequence_parallel, in_block, whole)
    tp_modules = {name: lora.base_layer(m) for name, m in named if name in converted}
    install_tp_rng(model, [m for m in tp_modules.values() if isinstance(m, megatron.ColumnParallel)
                           and not m.gather_output],
                   [m for m in tp_modules.values() if isinstance(m, megatron.RowParallel)],
                   [model.get_submodule(b) for b in blocks], rank, sequence_parallel)
    if sequence_parallel:
        enable_sequence_parallel(model, blocks, plan.sp_gather, group, sequence_dim, whole)
    model.merak_tp = TPInfo(tp, rank, plan, tuple(converted), parallel_vocab, sequence_parallel,
                            styles, examples)
    if overlap_level:
        set_tp_overlap(model, overlap_level, overlap_sub_batches)
    return model




def _hf_style(plan: TPPlan, name: str) -> str | None:
    return next((s for p, s in plan.hf_styles if matches(name, p)), None)


def _describe(plan: TPPlan, name: str, merak_style: str) -> str:
    hf = _hf_style(plan, name)
    return f"{hf} ({STYLE_MEANINGS.get(hf, merak_style)})" if hf else merak_style


def _any(name: str, patterns) -> bool:
    return any(matches(name, p) for p in patterns)


def _convert_linears(named, plan: TPPlan, config, group, rank: int, tp: int, cache: dict,
                     styles: dict, **sp) -> list[str]:
    converted = []
    for name, wrapper in named:
        module = lora.base_layer(wrapper)  # a LoRA layer's base layer takes the plan's style
        style = plan.style(name, module)
        chunks = None
        if style == "column":
            chunks = next((f if isinstance(f, tuple) else f(config)
                           for p, f in plan.fused.items() if matches(name, p)), None)
            parts = next((n for p, n in plan.packed.items() if matches(name, p)), None)
            if chunks is None and parts and isinstance(module, nn.Linear):
                chunks = (module.out_features // parts,) * parts
            gather = _any(name, plan.gather_output)
            megatron.make_column_parallel_(module, name, group, rank, tp, chunks=chunks,
                                         gather_output=gather, cache=cache, **sp)
            desc = "column-parallel" + (", output all-gathered" if gather else "")
        elif style == "row":
            megatron.make_row_parallel_(module, name, group, rank, tp, cache=cache, **sp)
            module.input_is_parallel = not _any(name, plan.split_input)
            desc = "row-parallel" + ("" if module.input_is_parallel else ", full input sliced")
        else:
            continue
        if module is not wrapper:
            lora_adapters.shard_adapters(wrapper, name, style, group, rank, tp,
                                chunks=chunks,
                                gather_output=getattr(module, "gather_output", False),
                                input_is_parallel=getattr(module, "input_is_parallel", True),
                                cache=cache)
            desc += ", LoRA adapters to match"
        styles[name] = _describe(plan, name, desc)
        converted.append(name)
    return converted


def _param_shard(plan: TPPlan, full: str, param) -> tuple[int, int] | None:
    """(dim, packed parts) of a bare parameter the plan splits (`param_shards`), else None."""
    axis = next((a for p, a in plan.param_shards.items() if matches(full, p)), None)
    if axis is None or (axis == "in" and full.endswith(".bias")):
        return None  # a row-parallel bias stays whole
    dim = param.dim() - 1 if axis == "in" else max(param.dim() - 2, 0)
    return dim, next((n for p, n in plan.packed.items() if matches(full, p)), 1)


def _convert_other_styles(named, plan: TPPlan, config, group, rank: int, tp: int, cache: dict,
                          styles: dict) -> list[str]:
    """Experts (partial sums), identity experts, MLA's kv_a_proj, embeddings in the blocks."""
    converted = []
    for name, module in named:
        if _any(name, plan.vocab_parallel):
            megatron.make_vocab_parallel_(module, name, group, rank, tp, cache=cache)
            desc = "vocab-parallel embedding"
        elif _any(name, plan.embedding_dim):
            wrappers.make_embedding_dim_parallel_(module, name, group, rank, tp, cache)
            desc = "embedding split along its features"
        elif _any(name, plan.rope_grad):
            wrappers.make_rope_grad_reduce_(module, name, group, config)
            desc = "replicated, rotary-key gradient summed"
        elif _any(name, plan.scaled_identity):
            wrappers.make_scaled_identity_(module, group, tp)
            desc = "identity expert, input divided by tp"
        else:
            desc = None
        if desc:
            styles[name] = _describe(plan, name, desc)
            converted.append(name)
    for name, module in named:  # after the identities inside them: parameters checked here
        if _any(name, plan.partial_sum):
            owned = {n for n, _ in module.named_parameters(recurse=False)
                     if f"{name}.{n}" in styles}
            wrappers.make_partial_sum_(module, name, group, owned)
            styles[name] = _describe(plan, name, "per-rank partial output summed over TP")
            converted.append(name)
    return converted


def _sharded_parents(named, plan: TPPlan) -> set[str]:
    """Modules directly holding a column-parallel layer whose output stays sharded."""
    return {name.rpartition(".")[0] for name, m in named
            if isinstance(lora.base_layer(m), megatron.ColumnParallel)
            and not lora.base_layer(m).gather_output}


def _divide_heads(module: nn.Module, name: str, tp: int) -> None:
    """`HEAD_ATTRS` of `module` and of a private copy of its config, where they are ints."""
    for attr in HEAD_ATTRS:
        if isinstance(getattr(module, attr, None), int):
            _divide_attr(module, name, attr, tp)
    config = getattr(module, "config", None)
    if config is not None and any(isinstance(getattr(config, a, None), int) for a in HEAD_ATTRS):
        module.config = copy.copy(config)
        for attr in HEAD_ATTRS:
            if isinstance(getattr(config, attr, None), int):
                _divide_attr(module.config, f"{name}.config", attr, tp)


def _divide_and_shard_heads(named, plan: TPPlan, rank: int, tp: int, cache: dict,
                            styles: dict) -> list[str]:
    """Per-rank head counts in attributes (and private configs); per-head parameters and bare
    parameters (`param_shards`) split."""
    sharded = []
    parents = _sharded_parents(named, plan) if plan.divide_heads else set()
    for name, module in named:
        if name in parents:
            _divide_heads(module, name, tp)
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
            bare = _param_shard(plan, full, param) if dim is None and \
                getattr(param, "tp_shard", None) is None else None
            if dim is not None:
                dim, chunks = dim if isinstance(dim, tuple) else (dim, None)
                if chunks is not None:  # (dim, period): each period split apart
                    chunks = (chunks,) * (param.shape[dim] // chunks)
                setattr(module, param_name,
                        megatron.shard_parameter(param, dim, rank, tp, chunks, cache))
                styles[full] = _describe(plan, full, f"split along dim {dim}")
            elif bare is not None:
                dim, parts = bare
                size = param.shape[dim]
                if size % (parts * tp):
                    raise ValueError(f"tp={tp} cannot split {full} (shape {tuple(param.shape)}) "
                                     f"along dim {dim}: {size} is not divisible by "
                                     f"{parts * tp}" + (f" ({parts} packed parts)" if parts > 1
                                                        else "") + "; choose a tp that divides "
                                     "it (for experts: the config's moe_intermediate_size / "
                                     "intermediate_size)")
                setattr(module, param_name, megatron.shard_parameter(
                    param, dim, rank, tp, (size // parts,) * parts, cache))
                styles[full] = _describe(plan, full, f"split along dim {dim}")
            else:
                continue
            sharded.append(full)
    return sharded


def _split_vocabulary(model: nn.Module, plan: TPPlan, group, rank: int, tp: int,
                      cache: dict) -> list[str]:
    """Vocab-parallel embedding; the LM head column-parallel with its logits gathered (so the
    model's own loss works), sharing the embedding's shard when the two are tied."""
    converted = []
    for name, module in model.named_modules():
        if any(matches(name, p) for p in plan.embeddings):
            megatron.make_vocab_parallel_(module, name, group, rank, tp, cache=cache)
        elif any(matches(name, p) for p in plan.lm_head):
            megatron.make_column_parallel_(module, name, group, rank, tp, gather_output=True,
                                         cache=cache)
        else:
            continue
        converted.append(name)
    if not converted:
        raise ValueError(f"parallel_vocab found none of {[*plan.embeddings, *plan.lm_head]} in "
                         f"{type(model).__name__}; set parallel_vocab=False")
    return converted


def _mark_partial_grads(model: nn.Module, plan: TPPlan, sequence_parallel: bool,
                        in_block, whole: tuple[str, ...] = ()) -> None:
    """Flag replicated parameters whose gradient is a per-rank part (``tp_partial_grad``): the
    pipeline interpreter sums those over the TP group before the optimizer step. With
    sequence parallelism, those in the blocks outside the modules run `whole` (an MoE layer's
    router sees the full sequences on every rank: its gradient is already complete)."""
    parents = _sharded_parents(list(model.named_modules()), plan)
    for name, param in model.named_parameters():
        if getattr(param, "tp_shard", None) is not None:
            continue
        module_name = name.rsplit(".", 1)[0]
        # a listed norm sees only this rank's heads when its holder also holds a column layer
        # whose output stays sharded; after a gathered projection it sees everything
        holder = module_name.rpartition(".")[0]
        if (_any(module_name, plan.partial_grad) and any(within(p, holder) for p in parents)) \
                or (sequence_parallel and in_block(name)
                    and not any(within(name, w) for w in whole)):
            param.tp_partial_grad = True
