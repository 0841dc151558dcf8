"""`merak.auto_split`: trace a model, cut it into stages, return the same `PipelineSplit` data
object a manual split gives (plus the stage graphs), ready for `PipelineStage`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from merak.materialize.fake_weights import FakeWeights, traceable_experts
from merak.materialize.meta import has_meta_parameters
from merak.options import given
from merak.partition.graph_rewrite import prepare_inputs, set_graph_device
from merak.partition.graph_split import split_model
from merak.partition.options import TRACE_METHODS, SplitOptions
from merak.partition.trace_cache import TraceCache, resolve_cache
from merak.stages import assign
from merak.stages.blocks import find_blocks, within
from merak.stages.split import Piece, PipelineSplit, find_tied_weights


@dataclass(frozen=True)
class AutoSplit(PipelineSplit):
    """A `PipelineSplit` whose pieces are one stage graph each, held by `container`.

    Calling it, ``split(**inputs)``, runs every stage in sequence in this process and returns
    what ``model(**inputs)`` returns (differentiably): for reference checks and debugging.
    """

    container: nn.Module | None = field(default=None, compare=False, repr=False)
    blocks_of_stage: tuple[tuple[str, ...], ...] = ()
    out_spec: Any = field(default=None, compare=False, repr=False)
    out_names: tuple[str, ...] = ()

    def stage_graph(self, stage_id: int) -> fx.GraphModule:
        return self.container.get_submodule(self.pieces[stage_id].module)

    def __call__(self, **inputs: torch.Tensor) -> Any:
        carry: dict[str, torch.Tensor] = {}
        for stage_id in range(self.num_stages):
            piece = self.pieces[stage_id]
            values = {**carry, **inputs}
            carry = self.stage_graph(stage_id)(*[values[n] for n in piece.inputs])
        leaves = [carry[name] for name in self.out_names]
        return pytree.tree_unflatten(leaves, self.out_spec) if self.out_spec else carry

    def describe(self) -> str:
        lines = []
        for s in range(self.num_stages):
            graph = self.stage_graph(s)
            params = {id(p): p.numel() for p in graph.parameters()}
            blocks = self.blocks_of_stage[s]
            span = f"{blocks[0]} .. {blocks[-1]} ({len(blocks)} blocks)" if blocks else "no blocks"
            lines.append(f"stage {s}: {span}, {sum(params.values()):,} parameters")
            if graph.batch_input_names:
                lines.append(f"  loads    {', '.join(graph.batch_input_names)}")
            for name in graph.recv_names:
                node = next(n for n in graph.graph.nodes
                            if n.op == "placeholder" and n.target == name)
                shape = getattr(node.meta.get("val"), "shape", "?")
                lines.append(f"  receives {name} {list(shape) if shape != '?' else shape}")
        for tied in self.tied_weights:
            lines.append("tied: " + " = ".join(f"stage {s}:{n}" for s, n in tied.names))
        return "\n".join(lines)


def _stage_of_block(blocks: list[str], num_stages: int, partition_method: str,
                    custom_partition: Sequence[int] | None,
                    custom_split_points: Sequence[str] | None,
                    weights: list[float] | None) -> list[int]:
    if custom_split_points is not None:
        unknown = [p for p in custom_split_points if p not in blocks]
        if unknown:
            raise ValueError(f"custom_split_points {unknown} are not blocks of this model; "
                             f"valid points are {blocks}")
        starts = sorted(blocks.index(p) for p in custom_split_points)
        if len(starts) + 1 != num_stages or 0 in starts:
            raise ValueError(f"{len(custom_split_points)} custom_split_points make "
                             f"{len(starts) + 1} stages, not {num_stages} (a point names the "
                             f"first block of a stage after the first)")
        return [sum(1 for st in starts if i >= st) for i in range(len(blocks))]
    if partition_method in ("uniform", "uniform_floor"):
        units = assign.uniform(len(blocks), num_stages, floor=partition_method == "uniform_floor",
                               num_before=0, num_after=0)
    elif partition_method == "custom":
        if custom_partition is None:
            raise ValueError("partition_method='custom' needs custom_partition, the block "
                             f"indices where stages start, e.g. [0, {len(blocks) // 2}, "
                             f"{len(blocks)}]")
        units = assign.custom(len(blocks), custom_partition, num_before=0, num_after=0)
        if max(units) + 1 != num_stages:
            raise ValueError(f"custom_partition {list(custom_partition)} makes {max(units) + 1} "
                             f"stages, not {num_stages}")
    else:  # "parameters" or "profile" (`SplitOptions` checked the name)
        units = assign.balanced(weights, num_stages)
    return units


def _block_weights(model: nn.Module, blocks: list[str], partition_method: str,
                   example_inputs: dict) -> list[float] | None:
    """Per-block weights; the glue before/after the blocks is added to the first/last block."""
    if partition_method == "parameters":
        in_blocks = {id(p) for b in blocks for p in model.get_submodule(b).parameters()}
        weights = [float(sum(p.numel() for p in model.get_submodule(b).parameters()))
                   for b in blocks]
        glue = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
        weights[0] += glue / 2
        weights[-1] += glue / 2
        return weights
    if partition_method == "profile":
        from merak.partition.profile import profile_blocks

        return profile_blocks(model, blocks, example_inputs)
    return None


def auto_split(model: nn.Module, example_inputs: dict[str, torch.Tensor], num_stages: int,
               options: SplitOptions | None = None, *,
               input_names: Sequence[str] | None = None, device: torch.device | str = "cpu",
               autocast_dtype: torch.dtype | None = None, verbose: bool = False,
               trace_cache: TraceCache | bool = True, **fields) -> AutoSplit:
    """Split `model` into `num_stages` pipeline stages automatically.

    Args:
        model: an HF `transformers` model or any `nn.Module`, possibly built inside
            `merak.init_empty_weights()` (parameters on the meta device).
        example_inputs: keyword inputs of one (micro-)batch; include ``labels`` so the last
            stage returns the loss.
        num_stages: pipeline stages.
        options: how to trace and where to cut (`SplitOptions`: trace_method, split_method,
            partition_method, custom_partition, custom_split_points, leaf_modules,
            no_tie_modules); its fields may also be given by name (``trace_method="fx"``).
        input_names: the model inputs to use (default: every key of `example_inputs`).
        device: where stage graphs will run (device constants baked in by export are rewritten).
        autocast_dtype: the `torch.autocast` dtype the stages will run under (mixed
            precision), or None. The model is traced under it, so regions the model runs with
            autocast switched off (HF's rotary embeddings and some norms, through
            ``maybe_autocast(enabled=False)``, which is a no-op unless autocast is on) are
            recorded as such and keep their float32 arithmetic in the stages, as in eager HF.
        trace_cache: reuse the export of a structurally identical model traced before in
            this process (`merak.partition.trace_cache`): True the process's cache, False
            none, or a `TraceCache` of one's own. ``MERAK_TRACE_CACHE=0`` turns it off.
    """
    o = given(SplitOptions, options, fields, "auto_split")
    if input_names is not None:
        unknown = [n for n in input_names if n not in example_inputs]
        if unknown:
            raise ValueError(f"input_names {unknown} are not in example_inputs "
                             f"({sorted(example_inputs)})")
        example_inputs = {n: example_inputs[n] for n in input_names}
    every_block = find_blocks(model)
    blocks = _blocks_that_run(model, example_inputs, every_block, device)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (an nn.ModuleList of "
                         f"layers that hold parameters) to split between stages; split it by hand "
                         f"with merak.manual_split")
    if num_stages > len(blocks):
        raise ValueError(f"cannot split {len(blocks)} blocks into {num_stages} stages: use at "
                         f"most {len(blocks)} stages")
    leaf_modules = list(dict.fromkeys([*o.leaf_modules,
                                       *_tp_glue_modules(model, every_block)]))
    weights = _block_weights(model, blocks, o.partition_method, example_inputs)
    stage_of = _stage_of_block(blocks, num_stages, o.partition_method, o.custom_partition,
                               o.custom_split_points if o.split_method == "layer_split" else None,
                               weights)
    start = time.perf_counter()
    graphs = _trace_and_split(model, example_inputs, dict(zip(blocks, stage_of)), num_stages,
                              blocks, tuple(leaf_modules), o.trace_method,
                              nearest=o.split_method == "nearest_min_deps", device=device,
                              autocast_dtype=autocast_dtype,
                              trace_cache=resolve_cache(trace_cache))
    for graph in graphs:
        set_graph_device(graph, device)
    if verbose:
        print(f"auto_split: traced and split in {time.perf_counter() - start:.1f} s")
    container = nn.Module()
    pieces = []
    for s, graph in enumerate(graphs):
        container.add_module(f"stage{s}", graph)
        pieces.append(Piece(f"stage{s}", [*graph.recv_names, *graph.batch_input_names],
                            graph.send_names, flat=True))
    last = graphs[-1]
    output = "loss" if "loss" in last.send_names else last.send_names[0]
    stage_of_piece = tuple(range(num_stages))
    tied = () if o.no_tie_modules else find_tied_weights(container, pieces, stage_of_piece)
    blocks_of_stage = tuple(tuple(b for b, s in zip(blocks, stage_of) if s == stage)
                            for stage in range(num_stages))
    return AutoSplit(tuple(pieces), stage_of_piece, output, tied, container=container,
                     blocks_of_stage=blocks_of_stage, out_spec=last.out_spec,
                     out_names=last.out_names)


def _trace_and_split(model, example_inputs, stage_of_block, num_stages, blocks, leaf_modules,
                     trace_method: str, nearest: bool, device,
                     autocast_dtype: torch.dtype | None,
                     trace_cache: TraceCache | None = None) -> list[fx.GraphModule]:
    fake = FakeWeights(model, device) if has_meta_parameters(model) else None
    if fake is not None:  # weights as storage-less tensors on the device they will run on
        fake.__enter__()
        example_inputs = fake.inputs(example_inputs)
    autocast = torch.autocast(torch.device(device).type, dtype=autocast_dtype,
                              enabled=autocast_dtype is not None)
    try:
        with traceable_experts(model), autocast:
            return split_model(model, example_inputs, stage_of_block, num_stages, blocks=blocks,
                               leaf_modules=leaf_modules, nearest=nearest,
                               restore=fake.restore if fake else None,
                               trace_method=trace_method,
                               shapes_from_received=not _sequence_parallel(model),
                               trace_cache=trace_cache)
    except ValueError:
        raise
    except Exception as error:
        raise RuntimeError(_capture_hint(model, trace_method, error)) from error
    finally:
        if fake is not None:
            fake.restore()


def _blocks_that_run(model: nn.Module, example_inputs: dict, blocks: list[str], device
                     ) -> list[str]:
    """`blocks` less those the inputs never run, when the model has several block lists or
    layer types: a multimodal model given text alone (Gemma-3's vision tower) keeps its text
    layers as the pipeline's blocks, and Mllama's cross-attention layers, skipped without an
    image, are in no stage. One forward without grad (on fake weights for a meta model) with
    a pre-hook per block finds them."""
    if len({b.rsplit(".", 1)[0] for b in blocks}) < 2 \
            and len({type(model.get_submodule(b)) for b in blocks}) < 2:
        return blocks
    ran: set[str] = set()
    hooks = [model.get_submodule(b).register_forward_pre_hook(
        lambda module, args, name=b: ran.add(name)) for b in blocks]
    try:
        with torch.no_grad(), traceable_experts(model):
            if has_meta_parameters(model):
                with FakeWeights(model, device) as fake, fake.mode:
                    model(**prepare_inputs(model, fake.inputs(example_inputs)))
            else:
                model(**prepare_inputs(model, example_inputs))
    finally:
        for hook in hooks:
            hook.remove()
    return [b for b in blocks if b in ran] or blocks


def _sequence_parallel(model: nn.Module) -> bool:
    """With sequence parallelism, received hidden states hold 1/tp of the sequence, so a stage
    must not read sequence lengths from them."""
    info = getattr(model, "merak_tp", None)
    return bool(info and info.sequence_parallel)


def _tp_glue_modules(model: nn.Module, blocks: list[str]) -> list[str]:
    """Tensor-parallel modules outside the blocks (vocab-parallel embedding, LM head): kept
    opaque, since their collectives only happen when they run eagerly. `blocks` are all the
    model's blocks, those the inputs never run included: a multimodal model's vision layers,
    sharded by its plan, do not run on text and are in no stage."""
    from merak.tensor_parallel.layers.megatron import is_tensor_parallel

    return [name for name, m in model.named_modules() if is_tensor_parallel(m)
            and not any(within(name, b) for b in blocks)]


def _capture_hint(model: nn.Module, trace_method: str, error: Exception) -> str:
    from merak.tensor_parallel.tracing.diagnose import explain_tp_failure

    tp_cause = explain_tp_failure(model, error)  # a shape error after TP: name the TP cause
    if tp_cause is not None:
        return tp_cause
    text = str(error).strip().splitlines()
    where = next((line for line in text if "File" in line or "module" in line.lower()), "")
    others = [m for m in TRACE_METHODS if m != trace_method]
    return (f"merak could not capture {type(model).__name__} with trace_method="
            f"{trace_method!r}: "
            f"{text[0] if text else type(error).__name__}\n{where}\nTry: use_cache=False in the "
            f"model config or inputs, leaf_modules=[<the failing module's name>] to keep it "
            f"opaque, trace_method={others[0]!r} or {others[1]!r}, or split it by hand with "
            f"merak.manual_split.")
