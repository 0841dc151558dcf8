"""Values a block computes that the model reads outside the block, besides its outputs.

transformers 5.x collects some per-layer values with forward hooks rather than returning them
(`OutputRecorder`): the router logits of every mixture-of-experts block, which the model's
auxiliary (load-balancing) loss reads after the last block. In the exported graph such a value
is an internal node of the block used by code after it, so the block cannot become one call to
its eager module as it stands.

The cure is generic: the submodule that produces the value (found from the node's module stack)
is exported again with every tensor of its output passed through `tap_mark`, an identity op
whose arguments say which module and which leaf of its output the value is. The block then
stays one eager call, and a *tap* reads that output: a forward hook on the submodule keeps its
latest output, and a `take_tap` node placed right after the block call (pinned to the block's
stage) hands it to the rest of the graph, which sends it to later stages like any other value,
gradients included.

Why a marker op rather than export's `preserve_module_call_signature` on the submodule: that
refuses a module whose output holds anything but tensors and plain scalars, and routers return
data-dependent sizes too (JetMoE's `expert_size` list is unbacked symbolic ints under export).
The marker only touches the tensor leaves, so any output structure works.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

_TAP_ATTR = "_merak_tap_output"
_HOOK_ATTR = "_merak_tap_hook"


@torch.library.custom_op("merak::tap_mark", mutates_args=())
def tap_mark(value: torch.Tensor, module: str, leaf: int) -> torch.Tensor:
    """Identity, marking `value` as leaf `leaf` of `module`'s output (export-time only)."""
    return value.clone()


@tap_mark.register_fake
def _tap_mark_fake(value, module, leaf):
    return torch.empty_like(value)


tap_mark.register_autograd(lambda ctx, grad: (grad, None, None))
_MARK = torch.ops.merak.tap_mark.default


@contextmanager
def marking(model: nn.Module, fqns: list[str]):
    """While exporting: every tensor leaf of each module `fqns`' output goes through
    `tap_mark`, so the graph says which module output an internal value is."""
    handles = []

    def hook_for(fqn):
        def hook(module, args, output):
            leaves, spec = pytree.tree_flatten(output)
            leaves = [tap_mark(v, fqn, i) if isinstance(v, torch.Tensor) else v
                      for i, v in enumerate(leaves)]
            return pytree.tree_unflatten(leaves, spec)
        return hook

    try:
        for fqn in fqns:
            module = model.get_submodule(fqn)  # first, so that recorder hooks see the marks
            handles.append(module.register_forward_hook(hook_for(fqn), prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _keep_output(module: nn.Module, args, output) -> None:
    setattr(module, _TAP_ATTR, output)


def install_tap(module: nn.Module) -> None:
    """Keep `module`'s latest output for `take_tap` (idempotent)."""
    if getattr(module, _HOOK_ATTR, None) is None:
        setattr(module, _HOOK_ATTR, module.register_forward_hook(_keep_output))


def take_tap(module: nn.Module, leaf: int, after: object = None):
    """Leaf `leaf` (pytree order) of `module`'s output in the call just made (`after` is the
    block call's result: an argument only so that the graph orders the read after the call)."""
    value = module.__dict__.pop(_TAP_ATTR, None)
    if value is None:
        raise RuntimeError(f"no output recorded for tapped module {type(module).__name__}: the "
                           f"block containing it did not run before its value was read")
    return pytree.tree_leaves(value)[leaf]


def is_tap_read(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is take_tap


def is_mark(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is _MARK


def escaping_modules(region: list[fx.Node], block: str, stack_paths, inside: set[fx.Node],
                     outputs: set[str]) -> set[str]:
    """Paths, relative to `block`, of the innermost submodules whose internal values are read
    after the block: by a node in no block region (`inside`: the nodes of every block), other
    than the block's own outputs (named in `outputs`)."""
    found = set()
    for n in region:
        if n.name not in outputs and any(u not in inside for u in n.users):
            paths = [p for p in stack_paths(n) if p.startswith(block + ".")]
            if paths:
                found.add(paths[-1][len(block) + 1:])
    return found


def tap_value(g: fx.Graph, model: nn.Module, call: fx.Node, node: fx.Node, block: str
              ) -> fx.Node | None:
    """A `take_tap` node after `call` giving the value of `node` (an internal node of `block`),
    when `node` is, or feeds, the `tap_mark` of an output of a submodule of `block`."""
    marks = [node] if is_mark(node) else [u for u in node.users if is_mark(u)]
    marks = [m for m in marks if m.args[1].startswith(block + ".")]
    if not marks:
        return None
    _, fqn, leaf = marks[0].args
    install_tap(model.get_submodule(fqn))
    anchor = call
    while anchor.next.op == "call_function" and anchor.next.target is operator.getitem \
            and anchor.next.args[0] is call:
        anchor = anchor.next
    with g.inserting_after(anchor):
        attr = g.get_attr(fqn)
    with g.inserting_after(attr):
        read = g.call_function(take_tap, (attr, leaf, call))
    read.meta["val"] = node.meta.get("val")
    return read


def drop_marks(g: fx.Graph) -> None:
    """Remove the `tap_mark`s left outside the collapsed blocks (they are identities)."""
    for n in list(g.nodes):
        if is_mark(n):
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)


# outputs every layer can record (`output_hidden_states`, `output_attentions`): the model
# returns them, so they never escape a block through a hook
_RETURNED = ("hidden_states", "attentions")


def recorded_submodules(model: nn.Module, blocks: list[str]) -> list[str]:
    """The submodules of `blocks` whose outputs transformers' `OutputRecorder` hooks will
    collect for the model to read after the blocks (the router logits of an MoE block with
    ``output_router_logits``): the `_can_record_outputs` entries the config asks for, other
    than the returned hidden states and attentions, matched by class as transformers matches
    them. A prediction of what `escaping_modules` finds in an export, so that the first
    export can already carry the marks; the caller checks it against the exported graph."""
    found = []
    for prefix, owner in model.named_modules():
        recorders = getattr(type(owner), "_can_record_outputs", None)
        config = getattr(owner, "config", None)
        if not isinstance(recorders, dict) or config is None:
            continue
        for key, spec in recorders.items():
            if key in _RETURNED or not getattr(config, f"output_{key}", False):
                continue
            target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
            layer = getattr(spec, "layer_name", None)
            if target is None:
                return []  # matched by name only: leave it to the export
            for name, module in owner.named_modules(prefix=prefix):
                if isinstance(module, target) and name not in found \
                        and (layer is None or f".{layer.strip('.')}." in name + ".") \
                        and any(name.startswith(b + ".") for b in blocks):
                    found.append(name)
    return found
