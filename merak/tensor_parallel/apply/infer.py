"""Tensor-parallel plans inferred from what a family's blocks do, for families with neither a
hand-written plan (`FAMILY_PLANS`) nor a config ``base_model_tp_plan``, or whose plan does not
support the config (`merak.tensor_parallel.apply.choice`).

The first block of each structure is recorded op by op on fake weights
(`merak.tensor_parallel.tracing.trace`). Each of its linear layers, in the order they run, is
tried as the seed of a group: made column-parallel, its sharded output is followed through the block
(`merak.tensor_parallel.tracing.propagate`). A group is placed when that output is split into
attention heads (viewed by a head count) or goes through an element-wise activation, and every
sharded value ends in a linear that reads it whole along its input features (row-parallel), or in a
block output the model never reads. What the walk meets on the way joins the group: the other
linears whose outputs meet the sharded values (the keys and values of the queries' heads), fused
parts of an output (q/k/v or gate/up, each split apart), parameters and block inputs along the
sharded dim (per-head biases, BLOOM's and MPT's ALiBi), replicated parameters that see only this
rank's part (their gradient is summed over TP), and the attributes of the block's modules or
configs that hold the sizes the views use (divided). No name is read. A linear no group places
stays replicated, which is exact, only less sharded, and the plan's ``notes`` say why; so does
a group the sharded model cannot run with (tried on a meta copy at rank 0's shapes: a shape
check the model makes in Python is not in the trace).

An inferred plan has ``check=True``: before training, `merak.tensor_parallel.tracing.proof` runs
each rank's sharded block against the unsharded one and refuses a plan that does not match.
"""

from __future__ import annotations

import dataclasses
import inspect
import pprint
import re
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from merak import lora
from merak.tensor_parallel.apply.convert import convert
from merak.tensor_parallel.plans.tp_plan import TPPlan, matches, plan_refusal
from merak.tensor_parallel.tracing.propagate import Region, propagate
from merak.tensor_parallel.tracing.shards import Unplaceable
from merak.tensor_parallel.tracing.trace import (
    BlockTrace,
    fake_run,
    meta_copy,
    signature,
    trace_model_blocks,
)

# attributes of the converted layers themselves: the layer conversion divides those
_LAYER_ATTRS = ("in_features", "out_features", "nf", "nx")


@dataclass
class BlockPlan:
    """The groups placed in one traced block, and why the other linears stay replicated."""

    order: list[str]  # the block's linears in the order they run
    groups: list[tuple[Region, dict[tuple[str, str], int]]]  # and the attributes to divide:
    # (owner path, attribute) -> its value
    replicated: dict[str, str]  # linear (relative name) -> why


def block_linears(block: nn.Module) -> dict[str, str]:
    """The block's linear layers: weight name -> module name (relative to the block). A LoRA
    layer is converted whole: its base layer's weight names the LoRA layer."""
    found = {}
    for name, module in block.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)) or ".lora_" in f".{name}":
            continue
        owner = name.removesuffix(".base_layer")
        if owner != name and not lora.is_lora_layer(block.get_submodule(owner)):
            owner = name
        found[f"{name}.weight"] = owner
    return found


def _grow(trace: BlockTrace, tp: int, seed: str, linears: dict[str, str],
          placed: set[str]) -> Region:
    """The group `seed` starts: the walk repeated with the columns and fused part boundaries
    it asks for until they settle. A walk that fails after a view split a column's whole
    output into k parts along the sharded dim (``view(b, s, 2, I)``: a fused gate and up
    projection, not two heads) is tried again with that output as k fused parts."""
    columns, bounds, tried, first = {seed}, {}, set(), None
    for _ in range(2 * len(linears) + 8):
        try:
            region = propagate(trace, tp, columns, linears, bounds)
        except Unplaceable as error:
            first = first or error
            seen = error.region.fused_guesses if hasattr(error, "region") else []
            guesses = [g for g in seen if g not in tried]
            if not guesses:
                raise first from None
            column, parts = guesses[0]
            tried.add(guesses[0])
            width = _widths(trace, linears)[column]
            bounds = {**bounds, column: set(range(0, width + 1, width // parts))}
            continue
        if region.more_columns & placed:
            raise Unplaceable(f"its sharded values meet {sorted(region.more_columns & placed)}, "
                              f"placed in another group")
        if region.more_columns - columns:
            columns |= region.more_columns
        elif region.bounds != bounds:
            bounds = region.bounds
        else:
            return region
    raise Unplaceable("its group did not settle")


def _widths(trace: BlockTrace, linears: dict[str, str]) -> dict[str, int]:
    """The output width of each linear the block calls."""
    found = {}
    for node in trace.nodes:
        for leaf in node.args[:3]:
            name = linears.get(trace.params.get(id(leaf), ""))
            if name and name not in found:  # its weight's output dim
                found[name] = leaf.shape[0 if len(leaf.shape) == 2 and node.name != "addmm"
                                         else -1]
    return found


def _attr_value(block: nn.Module, owner: str, attr: str) -> int | None:
    path = owner.removeprefix("config@")
    module = block.get_submodule(path)
    holder = module.config if owner.startswith("config@") else module
    value = getattr(holder, attr, None)
    return value if isinstance(value, int) else None


def _divisions(region: Region, block: nn.Module, tp: int) -> dict[tuple[str, str], int]:
    """One attribute of each size the views use along a sharded dim: the one the size is, else
    the one of its factors that is a sharded head count (a count of heads times their width)."""
    layers = region.columns | region.rows
    chosen: dict[tuple[str, str], int] = {}
    for sources in region.divide:
        usable = {}
        for owner, attr in sorted(sources):
            if owner in layers and attr in _LAYER_ATTRS:
                usable = {}
                break  # the layer's own size: its conversion divides it
            value = _attr_value(block, owner, attr)
            if value is not None and value % tp == 0:
                usable[(owner, attr)] = value
        if not usable or usable.keys() & chosen.keys():
            continue
        heads = [k for k, v in usable.items() if v in region.head_sizes]
        key = (heads or list(usable))[0]
        chosen[key] = usable[key]
    return chosen


def infer_block(trace: BlockTrace, block: nn.Module, tp: int) -> BlockPlan:
    """The groups of one traced block (see the module docstring)."""
    linears = block_linears(block)
    order = []
    for node in trace.nodes:
        for leaf in node.args[:3]:
            name = linears.get(trace.params.get(id(leaf), ""))
            if name and name not in order and (node.module == name
                                               or node.module.startswith(name + ".")):
                order.append(name)
    placed: set[str] = set()
    groups, replicated = [], {}
    for seed in order:
        if seed in placed:
            continue
        try:
            region = _grow(trace, tp, seed, linears, placed)
            if not region.rows:
                raise Unplaceable("its sharded output reaches no row-parallel linear")
            if not (region.heads or region.activation):
                raise Unplaceable("its output is neither split into heads nor goes through an "
                                  "activation before the next linear")
            if (region.columns | region.rows) & placed:
                raise Unplaceable("its row-parallel linear is placed in another group")
            divide = _divisions(region, block, tp)
        except Unplaceable as error:
            replicated[seed] = str(error)
            continue
        groups.append((region, divide))
        placed |= region.columns | region.rows
    replicated = {k: v for k, v in replicated.items() if k not in placed}
    return BlockPlan(order, groups, replicated)


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class _Patterns:
    """Plan patterns for names relative to one structure's blocks: ``<list>.*.<rel>`` when that
    matches exactly those blocks' modules, else each block's full name."""

    def __init__(self, model: nn.Module, members: list[str]):
        self.members = members
        self.names = {n for n, _ in model.named_modules()} | {
            n for n, _ in model.named_parameters(remove_duplicate=False)}

    def __call__(self, rel: str, whole_blocks: bool = False) -> tuple[str, ...]:
        targets = {f"{b}.{rel}" if rel else b for b in self.members}
        parents = {b.rpartition(".")[0] for b in self.members}
        if len(parents) == 1 and (rel or whole_blocks):
            glob = f"{parents.pop()}.*" + (f".{rel}" if rel else "")
            if whole_blocks or {n for n in self.names if matches(n, glob)} == targets:
                return (glob,)
        return tuple(sorted(targets, key=_natural))


def _module_name(model: nn.Module, module: nn.Module | None, kind: type) -> tuple[str, ...]:
    if not isinstance(module, kind):
        return ()
    return tuple(n for n, m in model.named_modules() if m is module)[:1]


def infer_plan(model: nn.Module, tp: int, device="cpu") -> TPPlan:
    """The plan inferred from `model`'s blocks for `tp` ranks, run as if on `device` (see the
    module docstring). The model sharded by it must run on fake weights (rank 0's shapes, no
    communication): a group it fails with is left replicated too (a model's own shape check in
    Python, which the trace does not see).

    Raises:
        ValueError: the model has no blocks, a block cannot run on fake weights, or no linear
            could be placed (the reasons for each).
    """
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    try:
        blocks, traces = trace_model_blocks(model, device)
    except Exception as error:  # noqa: BLE001 - any failure of the forward is the reason
        raise ValueError(f"plan inference could not run {family}'s blocks on fake weights "
                         f"({type(error).__name__}: {str(error).splitlines()[0][:200]})"
                         ) from error
    if not traces:
        raise ValueError(f"plan inference found no repeated blocks in {type(model).__name__}")
    groups, notes = [], []
    signatures = {b: signature(model.get_submodule(b)) for b in blocks}
    for name, trace in traces.items():
        pattern = _Patterns(model, [b for b in blocks if signatures[b] == signatures[name]])
        found = infer_block(trace, model.get_submodule(name), tp)
        rank = {n: i for i, n in enumerate(found.order)}
        groups += [(pattern, rank, region, divide) for region, divide in found.groups]
        notes += [f"{pattern(linear)[0]} stays replicated (tried as a column: {why})"
                  for linear, why in found.replicated.items()]
    plan = _assemble(model, groups, notes)
    if groups and _trial(model, plan, tp, device):
        kept = []
        for group in groups:
            failure = _trial(model, _assemble(model, [group], []), tp, device)
            if failure is None:
                kept.append(group)
            else:
                notes.append(f"{', '.join(group[0](c)[0] for c in sorted(group[2].columns))} "
                             f"stay replicated (the model sharded by them does not run: "
                             f"{failure})")
        groups, plan = kept, _assemble(model, kept, notes)
    if not groups:
        raise ValueError(f"plan inference placed no layer of {family} for tp={tp}: "
                         + "; ".join(notes or ["its blocks hold no linear layer"]))
    return plan


def _assemble(model: nn.Module, groups: list, notes: list[str]) -> TPPlan:
    """The plan of `groups`: (patterns of their blocks, linears' order, region, attributes)."""
    out: dict = {k: [] for k in ("column", "row", "partial_grad")}
    out.update({k: {} for k in ("fused", "divide", "own_config", "head_sharded",
                                "split_inputs")})
    for pattern, rank, region, divide in groups:
        for col in sorted(region.columns, key=rank.get):
            out["column"] += pattern(col)
            edges = sorted(region.bounds.get(col, ()))
            if len(edges) > 2:
                for p in pattern(col):
                    out["fused"][p] = tuple(b - a for a, b in zip(edges, edges[1:]))
        for row in sorted(region.rows, key=rank.get):
            out["row"] += pattern(row)
        for param, spec in sorted(region.param_shards.items()):
            for p in pattern(param):
                out["head_sharded"][p] = spec
        for param in sorted(region.partial):
            out["partial_grad"] += pattern(param.rpartition(".")[0])
        for path, (dim, period) in sorted(region.inputs.items()):
            for p in pattern("", whole_blocks=True):
                if (path, dim, period) not in out["split_inputs"].get(p, ()):
                    out["split_inputs"][p] = out["split_inputs"].get(p, ()) + ((path, dim,
                                                                                period),)
        for owner, attr in sorted(divide):
            key = "own_config" if owner.startswith("config@") else "divide"
            for p in pattern(owner.removeprefix("config@")):
                if attr not in out[key].get(p, ()):
                    out[key][p] = out[key].get(p, ()) + (attr,)
    return TPPlan(
        column=tuple(out["column"]), row=tuple(out["row"]), fused=out["fused"],
        divide=out["divide"], own_config=out["own_config"], head_sharded=out["head_sharded"],
        partial_grad=tuple(dict.fromkeys(out["partial_grad"])),
        split_inputs=out["split_inputs"], notes=tuple(notes),
        embeddings=_module_name(model, model.get_input_embeddings(), nn.Embedding)
        if hasattr(model, "get_input_embeddings") else (),
        lm_head=_module_name(model, model.get_output_embeddings(), nn.Linear)
        if hasattr(model, "get_output_embeddings") else (),
        source="inferred", check=True)


def _trial(model: nn.Module, plan: TPPlan, tp: int, device) -> str | None:
    """Why a meta copy of `model` sharded by `plan` (rank 0's part, no process group) does not
    run on fake weights; None when it runs."""
    try:
        copy = meta_copy(model)
    except Exception:  # noqa: BLE001 - a model that cannot be copied is not tried
        return None
    ctx = SimpleNamespace(tp=tp, tp_rank=0, tp_group=None, device=device)
    trial = dataclasses.replace(plan, check=False, notes=())
    try:  # (what apply_tensor_parallel does with the plan given)
        reason = plan_refusal(getattr(copy, "config", None), trial, tp)
        if reason:
            raise ValueError(reason)
        convert(copy, ctx, trial)
        with fake_run(copy, device) as ids, torch.no_grad(), \
                torch.random.fork_rng(devices=[]):
            extra = {"use_cache": False} \
                if "use_cache" in inspect.signature(copy.forward).parameters else {}
            copy(input_ids=ids, **extra)
    except Exception as error:  # noqa: BLE001 - any failure is the reason
        return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
    return None


def format_plan(plan: TPPlan, config=None) -> str:
    """`plan` as the Python expression of a `TPPlan` (the form of `FAMILY_PLANS`' entries), to
    copy, adjust and pass as ``MerakArguments(tp_plan=...)``: its fields that differ from the
    defaults (fused sizes evaluated on `config`), then its notes as comments."""
    lines = ["TPPlan("]
    for f in fields(TPPlan):
        value = getattr(plan, f.name)
        if f.name in ("notes", "hf_styles", "unsupported") or value == (
                f.default_factory() if callable(f.default_factory) else f.default):
            continue
        if f.name == "fused":
            value = {k: v if isinstance(v, tuple) or config is None else tuple(v(config))
                     for k, v in value.items()}
        text = pprint.pformat(value, width=92 - len(f.name), sort_dicts=False)
        lines.append(f"    {f.name}=" + text.replace("\n", "\n" + " " * (5 + len(f.name)))
                     + ",")
    lines.append(")")
    lines += [f"# {note}" for note in plan.notes]
    return "\n".join(lines)
