"""Cut a rewritten export graph into one GraphModule per pipeline stage.

Blocks go to the stage `stage_of_block` names; every other node goes to the earliest stage its
inputs allow. Cheap values computed only from model inputs and buffers (masks, rotary cos/sin,
position ids, shapes) are recomputed in each stage that needs them instead of being sent, so a
decoder-only boundary carries one hidden-state tensor. Values needed further on are relayed
through the stages in between.

Stage s is called as ``gm(*received, *batch_inputs)`` (placeholders: received values, then the
model inputs it reads) and returns a dict: the values crossing boundary s, or on the last stage
the model's outputs by name (``loss``, ``logits``, ...).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from merak.partition.capture import Capture, capture_export, capture_fx
from merak.partition.graph_rewrite import (
    dce,
    ident,
    is_view,
    nondeterministic,
    resolve,
    written_inputs,
)
from merak.partition.taps import is_tap_read
from merak.partition.trace_cache import TraceCache
from merak.partition.trace_key import trace_key
from merak.stages.blocks import find_blocks


# ----------------------------------------------------------------------------- stage assignment
def _classify(g: fx.Graph, model, gm) -> tuple[set, set]:
    """(free, tainted): nodes recomputable anywhere (inputs, buffers, pure cheap ops), and nodes
    written in place (or viewed by such writes), which never move from where they are made."""
    tainted, stack = set(), []
    for n in g.nodes:  # nodes mutated in place (and the bases they view) are never recomputed
        written = written_inputs(n)
        if written:
            tainted.add(n)
            stack += written
    while stack:
        x = stack.pop()
        if x not in tainted:
            tainted.add(x)
            if x.op in ("call_function", "call_method") and is_view(x) and x.args \
                    and isinstance(x.args[0], fx.Node):
                stack.append(x.args[0])
    free = set()
    for n in g.nodes:
        if n.op == "placeholder":
            free.add(n)
        elif n.op == "get_attr":
            free.add(n)  # parameters too: a get_attr is replicated into each stage that uses it
        elif (n.op in ("call_function", "call_method") and n not in tainted
              and not nondeterministic(n)):
            ins = n.all_input_nodes
            if all(i in free and not _is_param(i, model, gm) for i in ins):
                free.add(n)
    return free, tainted


def _is_param(n: fx.Node, model, gm) -> bool:
    return n.op == "get_attr" and isinstance(resolve(n.target, model, gm), nn.Parameter)


def _assign(g: fx.Graph, free: set, tainted: set, stage_of_block: dict, num_stages: int,
            nearest: bool) -> dict:
    """Blocks where `stage_of_block` says; other nodes at the earliest stage their inputs allow
    (`nearest`), or else moved as late as their consumers allow (fewer values relayed)."""
    stage = {}
    for n in g.nodes:
        if n in free or n.op == "output":
            continue
        prev = max((stage[i] for i in n.all_input_nodes if i in stage), default=0)
        if n.op == "call_module" and "block" in n.meta:
            stage[n] = stage_of_block[n.meta["block"]]
            if stage[n] < prev:
                raise ValueError(f"block {n.meta['block']} on stage {stage[n]} needs a value from "
                                 f"stage {prev}: stage_of_block must be non-decreasing in model "
                                 f"order")
        else:
            stage[n] = prev
        if not 0 <= stage[n] < num_stages:
            raise ValueError(f"stage {stage[n]} out of range for {n}")
    if not nearest:
        for n in reversed(list(stage)):
            if ("block" in n.meta or n in tainted or any(u in tainted for u in n.users)
                    or n.target is operator.getitem  # a tuple element stays with its tuple
                    or is_tap_read(n)):  # read right after the block call that recorded it
                continue
            users = [num_stages - 1 if u.op == "output" else stage[u] for u in n.users
                     if u.op == "output" or u in stage]
            if users:
                stage[n] = max(stage[n], min(users))
    return stage


# ----------------------------------------------------------------------------- stage building
def _closure(roots, free, stage, s, subst):
    """Nodes stage s must emit: its own nodes plus the free nodes they (transitively) read."""
    need, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        if n in need:
            continue
        need.add(n)
        if n in subst:
            continue  # shape read from a received tensor instead of its original input
        for i in n.all_input_nodes:
            if i in free or stage.get(i) == s:
                todo.append(i)
    return need


def _sym_substitutes(syms, cands):
    """sym_size(x, d) -> (tensor among cands, d') with the same symbolic size (x itself first)."""
    subst = {}
    for n in syms:
        expr = getattr(n.meta.get("val"), "node", None)
        for r in [n.args[0]] + list(cands):
            val = r.meta.get("val")
            if r not in cands or expr is None or not isinstance(val, torch.Tensor):
                continue
            dims = [d for d, sz in enumerate(val.shape)
                    if isinstance(sz, torch.SymInt) and sz.node.expr == expr.expr]
            if dims:
                subst[n] = (r, dims[0])
                break
    return subst


def capture(model: nn.Module, example_inputs: dict, blocks: list[str],
            leaf_modules: tuple[str, ...] = (), *, trace_method: str = "export",
            restore: Callable[[], None] | None = None, dynamic_batch: bool = False,
            trace_cache: TraceCache | None = None) -> Capture:
    """The whole model as one graph with `blocks` as calls to their eager modules. An export
    (``export`` / ``dynamo``) is looked up in and kept in `trace_cache` (see `trace_cache`)."""
    if trace_method == "fx":
        cap = capture_fx(model, example_inputs, blocks, leaf_modules)
    else:
        key = None if trace_cache is None else trace_key(
            model, example_inputs,
            (trace_method, dynamic_batch, tuple(blocks), tuple(leaf_modules)))
        cap = None if key is None else trace_cache.get(key, model)
        if cap is None:
            cap = capture_export(model, example_inputs, blocks, leaf_modules,
                                 strict=trace_method == "dynamo", dynamic_batch=dynamic_batch)
            if key is not None:
                trace_cache.put(key, cap, model)
    if restore is not None:  # real weights back before stages bind them
        restore()
    return cap


def split_model(model: nn.Module, example_inputs: dict, stage_of_block: dict,
                num_stages: int, *, blocks: list[str] | None = None,
                leaf_modules: tuple[str, ...] = (), nearest: bool = False,
                restore: Callable[[], None] | None = None, dynamic_batch: bool = False,
                trace_method: str = "export", shapes_from_received: bool = True,
                trace_cache: TraceCache | None = None) -> list[fx.GraphModule]:
    """One GraphModule per stage (see the module docstring). The last one also carries
    ``out_names`` and ``out_spec`` to rebuild the model's own output object. `trace_cache`:
    where to look up and keep the capture (see `capture`), or None."""
    blocks = find_blocks(model) if blocks is None else blocks
    missing = [b for b in blocks if b not in stage_of_block]
    if missing:
        raise ValueError(f"stage_of_block lacks blocks {missing}")
    cap = capture(model, example_inputs, blocks, leaf_modules, trace_method=trace_method,
                  restore=restore, dynamic_batch=dynamic_batch, trace_cache=trace_cache)
    gm, g = cap.gm, cap.gm.graph
    phs, in_names, out_leaves = list(cap.input_names), cap.input_names, cap.outputs

    free, tainted = _classify(g, model, gm)
    syms = {n for n in free if n.op == "call_function" and n.target == torch.ops.aten.sym_size.int}
    stage = _assign(g, free, tainted, stage_of_block, num_stages, nearest)
    last = num_stages - 1
    consumers = {}  # node -> stages that read it
    for n in g.nodes:
        for i in n.all_input_nodes:
            if i in stage:
                consumers.setdefault(i, set()).add(last if n.op == "output" else stage.get(n))
    order = {n: k for k, n in enumerate(g.nodes)}
    boundary = [[n for n in sorted(stage, key=order.get)
                 if stage[n] <= k and any(c > k for c in consumers.get(n, ()))]
                for k in range(num_stages - 1)]

    stages = []
    for s in range(num_stages):
        recv = boundary[s - 1] if s else []
        roots = [n for n in stage if stage[n] == s]
        roots += boundary[s] if s < last else [x for x in out_leaves if isinstance(x, fx.Node)]
        roots = [r for r in roots if r not in recv]
        # shapes: read them from a received tensor or an input this stage needs anyway
        base = _closure(roots, free, stage, s, syms)
        cands = (list(recv) if shapes_from_received else []) + [p for p in phs if p in base]
        subst = _sym_substitutes(syms, cands)
        need = _closure(roots, free, stage, s, subst)
        new, env = fx.Graph(), {}
        for r in recv:
            env[r] = new.placeholder(ident(r.name))
            env[r].meta.update(r.meta)
        batch = [p for p in phs if p in need]
        for p in batch:
            env[p] = new.placeholder(ident(in_names[p]))
            env[p].meta.update(p.meta)
        for n in g.nodes:
            if n in need and n not in env and n.op not in ("placeholder", "output"):
                if n in subst:
                    src, d = subst[n]
                    env[n] = new.call_function(torch.ops.aten.sym_size.int, (env[src], d))
                    env[n].meta.update(n.meta)
                else:
                    env[n] = new.node_copy(n, lambda x: env[x])  # noqa: B023
        if s < last:
            result = {ident(n.name): env[n] for n in boundary[s]}
        else:
            result = {k: (env[v] if isinstance(v, fx.Node) else v)
                      for k, v in zip(cap.out_names, out_leaves)}
        new.output(result)
        dce(new)
        attrs = {n.target: resolve(n.target, model, gm) for n in new.nodes
                 if n.op in ("get_attr", "call_module")}
        sgm = fx.GraphModule(attrs, new, class_name=f"Stage{s}")
        _keep_non_persistent(sgm, model)
        sgm.recv_names = tuple(env[r].target for r in recv)
        sgm.batch_input_names = tuple(in_names[p] for p in batch)
        sgm.send_names = tuple(result)
        stages.append(sgm)
    stages[-1].out_names, stages[-1].out_spec = tuple(cap.out_names), cap.out_spec
    return stages


def _keep_non_persistent(sgm: fx.GraphModule, model: nn.Module) -> None:
    """fx copies a graph's tensor attributes into its modules as persistent buffers; mark those
    the model keeps out of its state_dict (rotary ``inv_freq``) non-persistent again, so a
    stage's state_dict holds what the model's does (checkpoints, exports)."""
    for n in sgm.graph.nodes:
        if n.op != "get_attr":
            continue
        owner, _, name = n.target.rpartition(".")
        try:
            original = model.get_submodule(owner)
        except AttributeError:  # a constant export lifted: not the model's
            continue
        if name in original._non_persistent_buffers_set:
            sgm.get_submodule(owner)._non_persistent_buffers_set.add(name)
