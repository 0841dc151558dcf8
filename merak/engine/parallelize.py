"""`merak.parallelize`: the fixed 3D build order, from a (meta-built) model to this rank's stage.

    meta model -> tensor parallelism -> pipeline split -> materialize own stage (initialize
    exactly as the full model would, or load its shard from an HF safetensors checkpoint)
    -> the proof of an inferred tensor-parallel plan on this rank's blocks
    -> expert parallelism (ep > 1): each MoE layer keeps this rank's experts; when loading a
       checkpoint they are cut on the meta device before the load, so a rank reads and
       allocates only its own (after the load where an inferred TP plan must be proven on
       whole experts)
    -> data parallelism (the interpreter averages gradients over the dp group)

Tensor parallelism comes before the split so the split traces per-rank shapes and keeps the
TP modules outside the blocks opaque; materialization comes last so a rank only ever allocates
its own 1/(tp*pp) of the parameters (and 1/ep of the experts from a checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from merak import lora
from merak.distributed.parallel_context import ParallelContext, get_context
from merak.expert_parallel.shard import refuse_expert_adapters, shard_experts
from merak.materialize.conversion import CheckpointLayout
from merak.materialize.meta import materialize_
from merak.materialize.safetensors import load_safetensors_, pretrained_checkpoint
from merak.options import by_class, given
from merak.partition.auto import AutoSplit, auto_split
from merak.partition.options import SplitOptions
from merak.schedule.registry import placement_of, schedule_info
from merak.stages.stage import InterleavedStage, PipelineStage, interleaved_stage
from merak.tensor_parallel.apply.apply import apply_tensor_parallel
from merak.tensor_parallel.plans.options import TensorParallelOptions
from merak.tensor_parallel.tracing.diagnose import explain_tp_failure
from merak.tensor_parallel.tracing.proof import prove_plan, refusal


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of a shared parameter -> its other names (a checkpoint stores one of them)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {n: [o for o in group if o != n] for group in names.values() if len(group) > 1
            for n in group}


def parallelize(model: nn.Module, example_inputs: dict[str, torch.Tensor],
                ctx: ParallelContext | None = None, *,
                tensor_parallel: TensorParallelOptions | None = None,
                split: SplitOptions | None = None, schedule: str | None = None,
                num_model_chunks: int = 1, checkpoint: str | Path | None = None,
                checkpoint_prefix: str = "", device: torch.device | str | None = None,
                autocast_dtype: torch.dtype | None = None, **fields
                ) -> PipelineStage | InterleavedStage:
    """Build this rank's pipeline stage of `model` for the (dp, tp, pp) layout of `ctx`.

    Args:
        model: an HF or plain model, ideally built inside `merak.init_empty_weights()`; or a
            peft LoRA model of one (`merak.lora`): its parameters keep the names of the model
            peft wraps.
        example_inputs: one micro-batch of keyword inputs (with ``labels`` for the loss).
        ctx: the parallel context (default: the one from `merak.init`).
        tensor_parallel: `merak.apply_tensor_parallel`'s options (`TensorParallelOptions`:
            the plan, parallel_vocab, sequence_parallel, overlap_level, ...). Default plan:
            the one `set_tp_layer_lists` recorded on `ctx`, else the model family's, else the
            config's ``base_model_tp_plan``.
        split: `merak.auto_split`'s options (`SplitOptions`: trace_method, partition_method,
            ...).
        fields: fields of either options object by name (``plan=..., partition_method=...``).
        schedule: the training schedule the stage is built for (a `merak.SCHEDULES` name):
            it decides how many stages a rank holds (``zbv`` and ``dualpipev``: 2, whatever
            `num_model_chunks` says) and which (round-robin, or a V); default round-robin
            chunks.
        num_model_chunks: above 1, for interleaved schedules: the model is split into
            ``ctx.pp * num_model_chunks`` virtual stages and this rank's chunks are built and
            materialized together (tied weights within the rank stay one parameter).
        checkpoint: an HF safetensors file or directory to load this rank's shard from (in the
            layout `save_pretrained` writes: tensors transformers converts on load, such as a
            Mixtral's per-expert weights, are converted the same way); default: the directory
            of a model built by ``from_pretrained`` inside `init_empty_weights`, else initialize
            as the seeded single-process model would.
        checkpoint_prefix: a prefix of `model`'s parameter names that the checkpoint's names
            lack (a wrapper around the HF model, e.g. ``"model."``).
        device, autocast_dtype: see `merak.auto_split` (default device: ``ctx.device``).

    Returns:
        The `PipelineStage` (its ``split`` is the `AutoSplit`), ready for `PipelineInterpreter`;
        with model chunks, the `InterleavedStage`; either is ready for `PipelineInterpreter`.

    Raises:
        merak.tensor_parallel.tracing.proof.PlanRefused: on every rank, when the tensor-parallel
            plan was inferred from the blocks (the model's family has no other) and a rank's sharded
            block does not compute what the unsharded one does.
    """
    ctx = ctx or get_context()
    tp_fields, split_fields = by_class(fields, [TensorParallelOptions, SplitOptions],
                                       "parallelize")
    tensor_parallel = given(TensorParallelOptions, tensor_parallel, tp_fields, "parallelize")
    split = given(SplitOptions, split, split_fields, "parallelize")
    if lora.is_peft_model(model):  # LoRA: the peft layers live in the model peft wraps,
        model = model.get_base_model()  # whose forward is the peft model's (with **kwargs)
    if checkpoint is None:
        checkpoint = pretrained_checkpoint(model)
    adapters = any(lora.is_lora_layer(m) for m in model.modules())
    refuse_expert_adapters(model, ctx.ep)  # (before tensor parallelism changes anything)
    aliases = tied_aliases(model)
    # transformers' conversions for this model class (a Mixtral's per-expert checkpoint
    # tensors), read off the whole model before tensor parallelism replaces its modules
    layout = CheckpointLayout(model) if checkpoint is not None else None
    if checkpoint_prefix:
        strip = lambda n: n.removeprefix(checkpoint_prefix)
        aliases = {n: [strip(n), *map(strip, aliases.get(n, []))]
                   for n, _ in model.named_parameters(remove_duplicate=False)}
    apply_tensor_parallel(model, ctx, tensor_parallel)
    if num_model_chunks < 1:
        raise ValueError(f"num_model_chunks must be >= 1, got {num_model_chunks}")
    placement = None
    if schedule is not None:
        num_model_chunks = schedule_info(schedule).stages_per_rank(num_model_chunks)
        placement = placement_of(schedule, ctx.pp, num_model_chunks)
    try:
        pieces: AutoSplit = auto_split(model, example_inputs, ctx.pp * num_model_chunks, split,
                                       device=device or ctx.device,
                                       autocast_dtype=autocast_dtype)
    except RuntimeError as error:  # a plan to prove that does not even trace is refused
        info = getattr(model, "merak_tp", None)
        cause = (str(error) if str(error).startswith("a shape error inside") else
                 explain_tp_failure(model, error)) if info is not None and info.plan.check \
            else None
        if cause is not None:
            raise refusal(model, "fails its check: " + cause) from error
        raise
    if num_model_chunks > 1:
        stage = interleaved_stage(pieces, pieces.container, ctx, num_model_chunks, placement)
    else:
        stage = PipelineStage(pieces.container, pieces, ctx.pp_rank)
    info = getattr(model, "merak_tp", None)
    to_prove = info is not None and bool(info.examples)  # (on whole experts)
    if checkpoint is None:
        materialize_(stage, ctx.device)
    elif adapters:  # the base model's checkpoint: its weights load, the adapters initialize
        materialize_(stage, ctx.device)
        load_safetensors_(stage, checkpoint, aliases=lora.base_aliases(stage, aliases),
                          names=lora.base_names(stage, checkpoint, aliases), layout=layout)
    else:
        if not to_prove:  # ep > 1: each rank allocates and reads only its own experts
            shard_experts(stage, ctx)
        materialize_(stage, ctx.device, initialize=False)
        load_safetensors_(stage, checkpoint, aliases=aliases, layout=layout)
    if to_prove:  # an inferred plan, proven on this rank's blocks
        prove_plan(model, list(info.examples), ctx)
    shard_experts(stage, ctx)  # (ep > 1: the experts not sharded before the load)
    return stage
