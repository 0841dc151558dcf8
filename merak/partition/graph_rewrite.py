"""Graph rewrites on a torch.export capture: eager blocks back in, clean-ups, devices.

The model is exported non-strict with the repeated blocks' call signatures preserved; each
block's region of the flat graph is then replaced by one call to the ORIGINAL eager block, so
tensor parallelism, LoRA and recomputation wrappers still apply to it after the split.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import Dim
from torch.export.graph_signature import ConstantArgument, SymIntArgument, TensorArgument
from torch.utils import _pytree as pytree

from merak.partition.causal_mask import skip_unpadded_causal_mask
from merak.partition.taps import tap_value
from merak.stages.blocks import within

_DROP_TARGETS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


# ----------------------------------------------------------------------------- helpers
def spec_paths(spec, prefix=()):
    """Key path of every leaf of a TreeSpec (int for sequences, key for dicts / ModelOutputs)."""
    if spec.is_leaf():
        return [prefix]
    kids, ctx, out = spec.children(), spec.context, []
    keyed = (isinstance(ctx, (list, tuple)) and len(ctx) == len(kids)
             and spec.type not in (tuple, list))
    for i, c in enumerate(kids):
        out += spec_paths(c, prefix + ((ctx[i] if keyed else i),))
    return out


def ident(s: str) -> str:
    s = re.sub(r"\W", "_", str(s))
    return s if s and not s[0].isdigit() else "_" + s


def is_mutable(t) -> bool:
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


# torch-level (fx) graphs name ops by Python callables and method names, not ATen schemas
_FX_VIEW_METHODS = {"view", "view_as", "reshape", "transpose", "permute", "expand", "expand_as",
                    "unsqueeze", "squeeze", "narrow", "select", "t", "flatten", "unflatten",
                    "chunk", "split", "unbind", "as_strided", "detach", "contiguous"}
_FX_RANDOM = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
              torch.randint_like, torch.bernoulli, torch.multinomial, torch.normal,
              torch.dropout, torch.nn.functional.dropout, torch.nn.functional.dropout1d,
              torch.nn.functional.dropout2d, torch.nn.functional.alpha_dropout}


def _inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def written_inputs(n: fx.Node) -> list[fx.Node]:
    """The input nodes `n` writes in place (ATen schemas; Python in-place methods, setitem and
    `inplace=True` / `out=` in torch-level graphs)."""
    t, out = n.target, []
    if n.op == "call_function" and is_mutable(t):
        for a, v in zip(t._schema.arguments, n.args):
            if a.alias_info is not None and a.alias_info.is_write:
                out.append(v)
        out += [n.kwargs.get(a.name) for a in t._schema.arguments
                if a.alias_info is not None and a.alias_info.is_write]
    elif n.op == "call_method" and _inplace_name(t) or (
            n.op == "call_function" and (t is operator.setitem or n.kwargs.get("inplace") is True
                                         or _inplace_name(getattr(t, "__name__", "")))):
        out.append(n.args[0] if n.args else None)
    if n.op == "call_function" and isinstance(n.kwargs.get("out"), fx.Node):
        out.append(n.kwargs["out"])
    return [v for v in out if isinstance(v, fx.Node)]


def has_side_effect(n: fx.Node) -> bool:
    return bool(written_inputs(n)) or is_mutable(n.target)


def is_view(n: fx.Node) -> bool:
    t = n.target
    if n.op == "call_method":
        return t in _FX_VIEW_METHODS
    if t is operator.getitem:
        return True
    return (isinstance(t, torch._ops.OpOverload) and bool(t._schema.returns)
            and t._schema.returns[0].alias_info is not None)


def nondeterministic(n: fx.Node) -> bool:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in t.tags
    return (n.op == "call_function" and t in _FX_RANDOM
            or n.op == "call_method" and t in ("bernoulli", "multinomial"))


def stack_paths(n: fx.Node) -> list[str]:
    return [v[0] for v in (n.meta.get("nn_module_stack") or {}).values()]


def resolve(target: str, model: nn.Module, gm: fx.GraphModule):
    """Original object for a get_attr/call_module target (falls back to the exported module)."""
    for root in (model, gm):
        try:
            obj = root
            for a in target.split("."):
                obj = getattr(obj, a)
            return obj
        except AttributeError:
            pass
    raise KeyError(target)


def set_graph_device(gm: fx.GraphModule, device) -> fx.GraphModule:
    """Rewrite device constants baked in by export (arange/zeros/to(device=...)) to `device`,
    in the stage graph and its exported sub-graphs (e.g. the rotary no_grad body)."""
    device = torch.device(device)
    fix = lambda a: device if isinstance(a, torch.device) else a
    for mod in gm.modules():
        if isinstance(mod, fx.GraphModule):
            for n in mod.graph.nodes:
                if n.op == "call_function":
                    n.args = pytree.tree_map(fix, n.args)
                    n.kwargs = pytree.tree_map(fix, n.kwargs)
            mod.recompile()
    return gm


# ----------------------------------------------------------------------------- export
def export_with_blocks(model, kwargs, blocks, dynamic_batch=False, strict=False):
    dims = {0: Dim.AUTO, 1: Dim.AUTO} if dynamic_batch else {1: Dim.AUTO}
    dyn = {k: (dims if isinstance(v, torch.Tensor) and v.dim() >= 2 else None)
           for k, v in kwargs.items()}
    with _named_keywords(model, kwargs), skip_unpadded_causal_mask(kwargs):
        return torch.export.export(model, (), kwargs=kwargs, strict=strict, dynamic_shapes=dyn,
                                   preserve_module_call_signature=tuple(blocks))


@contextlib.contextmanager
def _named_keywords(model: nn.Module, kwargs: dict):
    """While exporting, a forward that names every input: inputs that reach the model through
    its ``**kwargs`` (HF's ``num_items_in_batch``, padding-free ``cu_seq_lens_q``) would
    otherwise have to be given `dynamic_shapes` as one nested dict, which torch.export cannot
    flatten (2.11-2.13: "Must provide a tree_name when there might be a mismatch"). An instance
    attribute, so the parameters keep their names."""
    params = inspect.signature(model.forward).parameters
    if not any(k not in params for k in kwargs) or "forward" in vars(model):
        yield
        return
    bound = type(model).forward

    def forward(**inputs):
        return bound(model, **inputs)

    forward.__signature__ = inspect.Signature(
        [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in kwargs])
    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def prepare_inputs(model, example_inputs):
    kw, seen = {}, set()
    for k, v in example_inputs.items():
        if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
            # aliased inputs would be merged by export -> clone (fake inputs never alias)
            key = (v.untyped_storage().data_ptr(), v.storage_offset())
            v = v.clone() if key in seen else v
            seen.add(key)
        kw[k] = v
    if "use_cache" in inspect.signature(model.forward).parameters:
        kw.setdefault("use_cache", False)
    return kw


# ----------------------------------------------------------------------------- graph rewrites
def cleanup(g: fx.Graph):
    for n in list(g.nodes):
        if (n.op == "call_module" and n.target == "_guards_fn"
                or n.op == "call_function" and n.target in _DROP_TARGETS and not n.users):
            g.erase_node(n)
        elif n.op == "call_function" and "tracepoint" in str(n.target):
            # the preserved-signature marker
            n.replace_all_uses_with(n.args[0] if len(n.args) == 1 else n.args)
            g.erase_node(n)


def block_region(g: fx.Graph, fqn: str) -> list[fx.Node]:
    """The nodes module `fqn` computes, less shape arithmetic that later code reuses."""
    region = [n for n in g.nodes if n.op == "call_function"
              and any(within(p, fqn) for p in stack_paths(n))]
    if not region:
        raise RuntimeError(f"no graph nodes found for block {fqn}")
    return _without_shared_shape_math(g, region)


def collapse_block(g: fx.Graph, fqn: str, sig, names: dict, is_block: bool = True,
                   tap=None) -> fx.Node:
    """Replace the nodes of module `fqn` by one call_module to the eager module. Blocks are
    placed on stages by the partition; other kept modules (`leaf_modules`) follow their inputs.
    An internal value read outside the block is taken from a tap (`taps.tap_value`) when `tap`
    (the model, exported with `taps.marking`) can say which submodule output it is."""
    region = block_region(g, fqn)
    rset = set(region)

    def arg(a):
        if isinstance(a, ConstantArgument):
            return a.value
        if isinstance(a, (TensorArgument, SymIntArgument)) and a.name in names:
            return names[a.name]
        raise RuntimeError(f"{fqn}: unsupported signature input {a}")

    args, kwargs = pytree.tree_unflatten([arg(a) for a in sig.inputs], sig.in_spec)
    in_names = {a.name for a in sig.inputs if not isinstance(a, ConstantArgument)}
    with g.inserting_before(region[0]):
        call = g.create_node("call_module", fqn, tuple(args), dict(kwargs))
        call._rename(ident(fqn))
        call.meta["block" if is_block else "leaf"] = fqn
        for i, (out, path) in enumerate(zip(sig.outputs, spec_paths(sig.out_spec))):
            old = names.get(out.name) if isinstance(out, TensorArgument) else None
            if old is None or old not in rset or out.name in in_names:
                continue  # constant / pass-through output (e.g. T5 position_bias): keep original
            leaf = call
            for k in path:
                leaf = g.call_function(operator.getitem, (leaf, k))
            if leaf is not call:
                leaf._rename(f"{call.name}_out{i}")
            leaf.meta["val"] = old.meta.get("val")
            old.replace_all_uses_with(leaf, delete_user_cb=lambda u: u not in rset)
            names[out.name] = leaf  # later blocks' signatures refer to the old name
    for n in reversed(region):
        bad = [u for u in n.users if u not in rset]
        if bad:
            read = _same_value_outside(n, rset)
            if read is None and tap:
                read = tap_value(g, tap, call, n, fqn)
            if read is None:
                raise RuntimeError(f"{fqn}: internal value {n} used outside the block by {bad}")
            n.replace_all_uses_with(read, delete_user_cb=lambda u: u not in rset)
        g.erase_node(n)
    return call


def _symbolic(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int,
                                          float, bool))


def _outside_size(g: fx.Graph, n: fx.Node) -> tuple[fx.Node, int] | None:
    """A model input with a dimension of the same symbolic size as ``sym_size`` node `n`."""
    expr = getattr(n.meta.get("val"), "node", None)
    if expr is None:
        return None
    for p in g.nodes:
        if p.op != "placeholder":
            continue  # placeholders come first
        val = p.meta.get("val")
        for d, size in enumerate(getattr(val, "shape", ())):
            if isinstance(size, torch.SymInt) and size.node.expr == expr.expr:
                return p, d
    return None


def _without_shared_shape_math(g: fx.Graph, region: list[fx.Node]) -> list[fx.Node]:
    """`region` less the shape arithmetic that later code reuses.

    Export deduplicates symbolic-shape expressions: ``batch * seq`` computed in block 0 (e.g.
    the token count an MoE block flattens its hidden states to, or ``min(seq, window)``) is the
    same fx node every later block's ``view`` reads, although its module stack names block 0.
    Such a node is computed from shapes alone, so it stays in the graph as ordinary glue,
    recomputable on any stage, instead of being swallowed by the eager block call; a size it
    reads from a tensor of the block is read from a model input of the same size instead.
    """
    rset = set(region)
    pure, sizes = set(), {}
    for n in region:
        if n.op == "call_function" and n.target == torch.ops.aten.sym_size.int \
                and n.args[0] in rset:
            source = _outside_size(g, n)
            if source is not None:
                sizes[n] = source
                pure.add(n)
        elif _symbolic(n) and all(i not in rset or i in pure for i in n.all_input_nodes):
            pure.add(n)
    keep = set()
    for n in reversed(region):
        if n in pure and any(u not in rset or u in keep for u in n.users):
            keep.add(n)
    for n in keep & set(sizes):
        n.args = sizes[n]
    return [n for n in region if n not in keep]


_IDENTITY_CASTS = {torch.ops.aten.to.dtype_layout, torch.ops.aten.to.dtype,
                   torch.ops.aten.to.device, torch.ops.aten.alias.default}


def _same_value_outside(n: fx.Node, region: set) -> fx.Node | None:
    """The node outside `region` whose value `n` merely passes on, if any: a ``.to()`` that
    changes nothing returns its own input, so non-strict export records later readers of that
    tensor (the next block's rotary table) as readers of the cast inside this block."""
    while n in region:
        if n.target not in _IDENTITY_CASTS or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        src, out = n.args[0].meta.get("val"), n.meta.get("val")
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or (
                src.dtype, src.device, src.shape) != (out.dtype, out.device, out.shape):
            return None
        n = n.args[0]
    return n


def eagerize_dropout(g: fx.Graph, model: nn.Module):
    """aten.dropout nodes that came from an nn.Dropout -> call_module (follows model.eval())."""
    for n in list(g.nodes):
        if n.op == "call_function" and n.target == torch.ops.aten.dropout.default:
            paths = stack_paths(n)
            try:
                mod = model.get_submodule(paths[-1]) if paths else None
            except AttributeError:
                mod = None
            if isinstance(mod, nn.Dropout):
                with g.inserting_before(n):
                    new = g.create_node("call_module", paths[-1], (n.args[0],))
                new.meta.update(n.meta)
                n.replace_all_uses_with(new)
                g.erase_node(n)


def dce(g: fx.Graph):
    for n in reversed(list(g.nodes)):
        if (n.op in ("call_function", "call_method", "get_attr") and not n.users
                and not has_side_effect(n)):
            g.erase_node(n)


def canonicalize_attrs(g: fx.Graph, model: nn.Module, gm: fx.GraphModule):
    """Drop unused get_attrs; name tied tensors by their first name in model.named_parameters()
    (export may pick e.g. 'lm_head.weight' for GPT-2's tied token embedding)."""
    canon = {id(t): k for k, t in [*model.named_parameters(), *model.named_buffers()]}
    for n in list(g.nodes):
        if n.op == "get_attr" and not n.users:
            g.erase_node(n)
        elif n.op == "get_attr":
            n.target = canon.get(id(resolve(n.target, model, gm)), n.target)
