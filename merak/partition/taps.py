"""Values a block computes that the model reads outside the block, besides its outputs.

transformers 5.x collects some per-layer values with forward hooks rather than returning them
(`OutputRecorder`): the router logits of every mixture-of-experts block, which the model's
auxiliary (load-balancing) loss reads after the last block. In the exported graph such a value
is an internal node of the block used by code after it, so the block cannot become one call to
its eager module as it stands.

The cure is generic: the submodule that produces the value (found from the node's module stack)
gets its call signature preserved in a second export, which says which output of the submodule
the value is. The block then stays one eager call, and a *tap* reads that output: a forward
hook on the submodule keeps its latest output, and a `take_tap` node placed right after the
block call (pinned to the block's stage) hands it to the rest of the graph, which sends it to
later stages like any other value, gradients included.
"""

from __future__ import annotations

import operator

from torch import fx, nn

_TAP_ATTR = "_merak_tap_output"
_HOOK_ATTR = "_merak_tap_hook"


def _keep_output(module: nn.Module, args, output) -> None:
    setattr(module, _TAP_ATTR, output)


def install_tap(module: nn.Module) -> None:
    """Keep `module`'s latest output for `take_tap` (idempotent)."""
    if getattr(module, _HOOK_ATTR, None) is None:
        setattr(module, _HOOK_ATTR, module.register_forward_hook(_keep_output))


def take_tap(module: nn.Module, path: tuple, after: object = None):
    """The element `path` of `module`'s output in the call just made (`after` is the block
    call's result: an argument only so that the graph orders the read after the call)."""
    value = module.__dict__.pop(_TAP_ATTR, None)
    if value is None:
        raise RuntimeError(f"no output recorded for tapped module {type(module).__name__}: the "
                           f"block containing it did not run before its value was read")
    for key in path:
        value = value[key]
    return value


def is_tap_read(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is take_tap


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


def tap_value(g: fx.Graph, model: nn.Module, call: fx.Node, node: fx.Node, block: str,
              sigs: dict, spec_paths) -> fx.Node | None:
    """A `take_tap` node after `call` giving the value of `node` (an internal node of `block`),
    when `node` is an output of a submodule of `block` whose signature was preserved."""
    for fqn, sig in sigs.items():
        if sig is None or not fqn.startswith(block + "."):
            continue
        for out, path in zip(sig.outputs, spec_paths(sig.out_spec)):
            if getattr(out, "name", None) != node.name:
                continue
            module = model.get_submodule(fqn)
            install_tap(module)
            anchor = call
            while anchor.next.op == "call_function" and anchor.next.target is operator.getitem \
                    and anchor.next.args[0] is call:
                anchor = anchor.next
            with g.inserting_after(anchor):
                attr = g.get_attr(fqn)
            with g.inserting_after(attr):
                read = g.call_function(take_tap, (attr, tuple(path), call))
            read.meta["val"] = node.meta.get("val")
            return read
    return None
