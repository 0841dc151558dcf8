"""Capture a model as one flat fx graph whose blocks are calls to the ORIGINAL eager modules.

Three front-ends (`trace_method`) produce the same `Capture`, which `graph_split` cuts into
stages:

- ``export``: torch.export, non-strict (Python runs the model, tensors are fake), with a dynamic
  sequence length. Works on every transformers 5.x family; the default.
- ``dynamo``: torch.export, strict: TorchDynamo captures the bytecode, then the same rewrites.
  Slower (seconds per model) and stricter about Python side effects, but it catches graph breaks
  the non-strict tracer lets through.
- ``fx``: `torch.fx.symbolic_trace` with the blocks (and `leaf_modules`) as leaf modules, for
  custom models written to be fx-traceable. transformers 5.x models are not.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx._symbolic_trace import _assert_is_none
from torch.utils import _pytree as pytree

from merak.partition.graph_rewrite import (
    block_region,
    canonicalize_attrs,
    cleanup,
    collapse_block,
    dce,
    eagerize_dropout,
    export_with_blocks,
    prepare_inputs,
    spec_paths,
    stack_paths,
)
from merak.partition.taps import drop_marks, escaping_modules, marking, recorded_submodules


class CaptureError(RuntimeError):
    """The front-end could not trace the model (whatever error type the tracer raised)."""


@dataclass
class Capture:
    """A flat graph (`gm.graph`) of the whole model; `gm` owns attributes the model lacks."""

    gm: fx.GraphModule
    input_names: dict[fx.Node, str]  # placeholder -> model input name
    outputs: list[Any]  # leaves of the model's output (nodes or constants)
    out_names: list[str]
    out_spec: Any


def _outputs(out_node: fx.Node, spec) -> tuple[list, list[str]]:
    leaves = pytree.tree_leaves(out_node.args[0])
    names = [".".join(map(str, p)) or "out" for p in spec_paths(spec)]
    if len(leaves) != len(names):
        names = [f"out{i}" for i in range(len(leaves))]
    return leaves, names


def capture_export(model: nn.Module, example_inputs: dict, blocks: list[str],
                   leaf_modules: tuple[str, ...], *, strict: bool = False,
                   dynamic_batch: bool = False,
                   restore: Callable[[], None] | None = None) -> Capture:
    """torch.export (non-strict, or strict = TorchDynamo) with block signatures preserved."""
    kwargs = prepare_inputs(model, example_inputs)
    # the submodules whose values leave the blocks get their outputs marked (`taps`); those
    # transformers' recorder hooks will collect are marked in the first export already, and
    # the export is made again only when the graph shows another set
    marked = recorded_submodules(model, blocks)
    with marking(model, marked):
        ep = _export(model, kwargs, [*blocks, *leaf_modules], dynamic_batch, strict)
    gm = ep.module()
    cleanup(gm.graph)
    tapped = _tapped_submodules(model, gm.graph, blocks, ep.module_call_graph)
    if sorted(tapped) != sorted(marked):
        with marking(model, tapped):
            ep = _export(model, kwargs, [*blocks, *leaf_modules], dynamic_batch, strict)
        gm = ep.module()
        cleanup(gm.graph)
    if restore is not None:  # real weights back before stages bind them
        restore()
    g = gm.graph
    sigs = {e.fqn: e.signature for e in ep.module_call_graph}
    names = {n.name: n for n in g.nodes}
    # last block first: export shares values between blocks (a size or mask computed in
    # block 0 and read by block 1's nodes); once block 1 is one call, block 0 is their only user
    for b in reversed(blocks):
        collapse_block(g, b, sigs[b], names, tap=model if tapped else None)
    for leaf in leaf_modules:
        collapse_block(g, leaf, sigs[leaf], names, is_block=False)
    drop_marks(g)
    eagerize_dropout(g, model)
    canonicalize_attrs(g, model, gm)
    root_sig = sigs[""]
    phs = [n for n in g.nodes if n.op == "placeholder"]
    input_names = {p: str(path[-1]) for p, path in zip(phs, spec_paths(root_sig.in_spec))}
    leaves, out_names = _outputs(next(n for n in g.nodes if n.op == "output"), root_sig.out_spec)
    return Capture(gm, input_names, leaves, out_names, root_sig.out_spec)


def _export(model, kwargs, preserved, dynamic_batch, strict):
    try:
        return export_with_blocks(model, kwargs, preserved, dynamic_batch, strict=strict)
    except Exception as error:  # tracer errors of any type are capture failures
        raise CaptureError(f"{type(error).__name__}: {error}") from error


def _tapped_submodules(model: nn.Module, g: fx.Graph, blocks: list[str], call_graph
                       ) -> list[str]:
    """Submodules of the blocks (in every block alike) with internal values read after the
    blocks: hook-recorded outputs such as MoE router logits (see `taps`)."""
    regions = {b: block_region(g, b) for b in blocks}
    inside = {n for region in regions.values() for n in region}
    outputs = {e.fqn: {getattr(o, "name", None) for o in e.signature.outputs}
               for e in call_graph if e.signature is not None}
    relative = set()
    for b in blocks:
        relative |= escaping_modules(regions[b], b, stack_paths, inside, outputs.get(b, set()))
    found = []
    for b in blocks:
        for rel in sorted(relative):
            try:
                model.get_submodule(f"{b}.{rel}")
            except AttributeError:
                continue
            found.append(f"{b}.{rel}")
    return found


class _BlockTracer(fx.Tracer):
    def __init__(self, opaque: set[str]):
        super().__init__()
        self.opaque = opaque

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.opaque or super().is_leaf_module(m, qualname)


class _RecordShapes(fx.Interpreter):
    """Runs the graph once (on meta for a meta model) and keeps each value as ``meta['val']``."""

    def run_node(self, n):
        result = super().run_node(n)
        n.meta["val"] = result
        return result


def capture_fx(model: nn.Module, example_inputs: dict, blocks: list[str],
               leaf_modules: tuple[str, ...]) -> Capture:
    """torch.fx symbolic tracing; forward arguments absent from `example_inputs` are fixed to
    their defaults (fx's concrete_args), so the stages take only the given inputs."""
    params = inspect.signature(model.forward).parameters
    unknown = [k for k in example_inputs if k not in params]
    if unknown:
        raise ValueError(f"example_inputs {unknown} are not arguments of "
                         f"{type(model).__name__}.forward ({list(params)})")
    concrete = {k: p.default for k, p in params.items() if k not in example_inputs
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    missing = [k for k, v in concrete.items() if v is inspect.Parameter.empty]
    if missing:
        raise ValueError(f"{type(model).__name__}.forward needs {missing}: add them to "
                         f"example_inputs")
    try:
        graph = _BlockTracer({*blocks, *leaf_modules}).trace(model, concrete_args=concrete)
    except Exception as error:  # tracer errors of any type are capture failures
        raise CaptureError(f"{type(error).__name__}: {error}") from error
    gm = fx.GraphModule(model, graph)
    g = gm.graph
    for n in reversed(list(g.nodes)):  # fx's checks that concrete args keep their values
        if n.op == "call_function" and n.target in (torch._assert, _assert_is_none):
            g.erase_node(n)
    order = [k for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    phs = [n for n in g.nodes if n.op == "placeholder"]
    input_names = dict(zip(phs, order))  # fx renames e.g. `scale` to `scale_1`
    for ph in phs:
        if input_names[ph] in concrete:
            value = concrete[input_names.pop(ph)]
            for user in list(ph.users):
                user.args = fx.node.map_arg(user.args,
                                            lambda a, ph=ph, v=value: v if a is ph else a)
                user.kwargs = fx.node.map_arg(user.kwargs,
                                              lambda a, ph=ph, v=value: v if a is ph else a)
            g.erase_node(ph)
    dce(g)
    for n in g.nodes:
        if n.op == "call_module" and n.target in blocks:
            n.meta["block"] = n.target
        elif n.op == "call_module" and n.target in leaf_modules:
            n.meta["leaf"] = n.target
    canonicalize_attrs(g, model, gm)
    gm.recompile()
    _RecordShapes(gm).run(*[example_inputs[name] for name in input_names.values()])
    out_node = next(n for n in g.nodes if n.op == "output")
    _, spec = pytree.tree_flatten(out_node.args[0])
    leaves, out_names = _outputs(out_node, spec)
    return Capture(gm, input_names, leaves, out_names, spec)
