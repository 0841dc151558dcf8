"""Reuse of captures within a process: a later build of a structurally identical model skips
torch.export.

Exporting a model takes seconds, and a process often builds the same model several times (a
pool of test scenarios, dry runs of the strategy search, one trainer after another). A
`TraceCache` keeps the last few captures (`capture.Capture`, after the rewrites that put the
eager blocks back) under `trace_key.trace_key`: the model's structure and attributes, the
example inputs' names, shapes and dtypes, the capture options and torch's global state. A hit
hands out a deep copy of the cached fx graph bound to the NEW model: every ``get_attr`` and
``call_module`` resolves on the new model, and the few attributes the model lacks (constants
export lifted, sub-graphs) are fresh copies. The cache never holds a model, a parameter or a
buffer: the graph it keeps names them by their paths only, and a capture whose graph holds any
tensor or module by value is not cached at all.

`auto_split` uses the process's cache, `process_trace_cache()` (a module-level `TraceCache`,
since builds in one process share nothing else that could hold it; ``.clear()`` empties it),
unless given ``trace_cache=False`` or a `TraceCache` of its own.
``MERAK_TRACE_CACHE=0`` in the environment turns every cache off (no lookups, no stores).
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from merak.partition.capture import Capture
from merak.partition.taps import install_tap, is_tap_read

ENV = "MERAK_TRACE_CACHE"


def enabled() -> bool:
    """False when the environment says ``MERAK_TRACE_CACHE=0`` (or ``false`` / ``off``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@dataclass
class _Entry:
    """A capture with nothing of its model in it: the graph names attributes by path only."""

    graph: fx.Graph
    input_names: dict[str, str]  # placeholder name -> model input name
    outputs: list[tuple[str, Any]]  # ("node", node name) or ("const", value)
    out_names: list[str]
    out_spec: Any
    extras: dict[str, Any]  # attributes the model lacks: lifted constants, sub-graphs
    taps: list[str]  # submodules whose outputs the graph reads (`taps.install_tap`)


class TraceCache:
    """At most `max_entries` captures, least recently used dropped first."""

    def __init__(self, max_entries: int = 4):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0

    def get(self, key: tuple | None, model: nn.Module) -> Capture | None:
        """The capture stored under `key`, rebuilt on `model`; None on a miss."""
        if key is None or not enabled():
            return None
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return _thaw(entry, model)

    def put(self, key: tuple | None, capture: Capture, model: nn.Module) -> None:
        """Keep `capture` of `model` under `key` (not if anything in it is uncertain)."""
        if key is None or not enabled() or self.max_entries < 1:
            return
        entry = _freeze(capture, model)
        if entry is None:
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


_PROCESS_CACHE = TraceCache()


def process_trace_cache() -> TraceCache:
    """The cache `auto_split` shares between the builds of this process."""
    return _PROCESS_CACHE


def resolve_cache(trace_cache: TraceCache | bool) -> TraceCache | None:
    """`auto_split`'s ``trace_cache`` argument as a cache: True the process's, False none."""
    if trace_cache is True:
        return _PROCESS_CACHE
    if trace_cache is False or trace_cache is None:
        return None
    if not isinstance(trace_cache, TraceCache):
        raise TypeError(f"trace_cache must be a bool or a TraceCache, not "
                        f"{type(trace_cache).__name__}")
    return trace_cache


# ----------------------------------------------------------------------------- freeze / thaw
def _on_model(model: nn.Module, target: str) -> bool:
    obj = model
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


_PLAIN = (fx.Node, type(None), bool, int, float, complex, str, torch.dtype, torch.device,
          torch.layout, torch.memory_format, slice, type(Ellipsis))
# ops whose arguments name process groups: a graph calling them is bound to its groups
_GROUP_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                     "_dtensor"}


def _portable(graph: fx.Graph, model_tensors: set[int]) -> bool:
    """Whether `graph` can serve another model: its arguments are nodes and plain constants
    only (no tensor, module, process group or other object held by value), it calls no
    collective, and no value recorded on a node is one of the model's own tensors."""
    for n in graph.nodes:
        if not all(isinstance(x, _PLAIN) for x in pytree.tree_leaves((n.args, n.kwargs))):
            return False
        if getattr(n.target, "namespace", None) in _GROUP_NAMESPACES:
            return False
        recorded = pytree.tree_leaves((n.meta.get("val"), n.meta.get("example_value")))
        if any(isinstance(x, nn.Module) or id(x) in model_tensors for x in recorded):
            return False
    return True


def _copy_extra(value):
    """A fresh copy of an attribute the model lacks, or None when it cannot be one."""
    if isinstance(value, fx.GraphModule):  # a sub-graph (autocast / no_grad region)
        if any(True for _ in value.parameters()) or any(True for _ in value.buffers()) \
                or not all(_portable(m.graph, set()) for m in value.modules()
                           if isinstance(m, fx.GraphModule)):
            return None
        return copy.deepcopy(value)
    if isinstance(value, torch.Tensor) and not isinstance(value, (FakeTensor, nn.Parameter)) \
            and value.device.type != "meta":
        return value.detach().clone()
    return None


def _copy_graph(graph: fx.Graph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of `graph` (node names, meta and codegen kept) and its node map, old -> new."""
    new, nodes = fx.Graph(tracer_cls=graph._tracer_cls), {}
    out = new.graph_copy(graph, nodes, return_output_node=True)
    new._codegen = graph._codegen  # its pytree specs are never changed: shared
    if out is not None:
        value, old_output = out
        output = new.output(value, type_expr=getattr(old_output, "type", None))
        output.meta = copy.copy(old_output.meta)
        nodes[old_output] = output
    return new, nodes


def _freeze(cap: Capture, model: nn.Module) -> _Entry | None:
    model_tensors = {id(t) for t in [*model.parameters(), *model.buffers()]}
    if not _portable(cap.gm.graph, model_tensors):
        return None
    graph, memo = _copy_graph(cap.gm.graph)
    extras, taps = {}, []
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module") and not _on_model(model, n.target):
            value = _copy_extra(cap.gm.get_submodule(n.target) if n.op == "call_module"
                                else _attr(cap.gm, n.target))
            if value is None:
                return None
            extras[n.target] = value
        if is_tap_read(n):
            taps.append(n.args[0].target)
    outputs = []
    for leaf in cap.outputs:
        if isinstance(leaf, fx.Node):
            outputs.append(("node", memo[leaf].name))
        elif isinstance(leaf, (torch.Tensor, nn.Module)):
            return None
        else:
            outputs.append(("const", leaf))
    return _Entry(graph, {memo[p].name: name for p, name in cap.input_names.items()}, outputs,
                  list(cap.out_names), cap.out_spec, extras, taps)


def _attr(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _thaw(entry: _Entry, model: nn.Module) -> Capture:
    graph, _ = _copy_graph(entry.graph)
    attrs = {}
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module") and n.target not in attrs:
            extra = entry.extras.get(n.target)
            attrs[n.target] = _attr(model, n.target) if extra is None else _copy_extra(extra)
    gm = fx.GraphModule(attrs, graph)
    for fqn in entry.taps:
        install_tap(model.get_submodule(fqn))
    nodes = {n.name: n for n in graph.nodes}
    outputs = [nodes[v] if kind == "node" else v for kind, v in entry.outputs]
    input_names = {nodes[p]: name for p, name in entry.input_names.items()}
    return Capture(gm, input_names, outputs, list(entry.out_names), entry.out_spec)
