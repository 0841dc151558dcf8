"""Apply a tensor-parallel plan to a (meta-built) model, in place, before it is split.

Build order: meta model -> `apply_tensor_parallel` -> `auto_split` -> materialize own
stage -> dp. The plan is chosen (`merak.tensor_parallel.apply.choice`) and checked here, and the
modules converted by `merak.tensor_parallel.apply.convert`: they keep their names, so each rank
materializes or loads exactly its shard (`ShardSpec`), and the pipeline split keeps the TP
modules that live outside the repeated blocks (embedding, LM head) as opaque eager calls.
"""

from __future__ import annotations

import warnings

from torch import nn

from merak.distributed.parallel_context import ParallelContext, get_context
from merak.options import given
from merak.tensor_parallel.apply.choice import plan_for
from merak.tensor_parallel.apply.convert import TPInfo, convert  # noqa: F401 - TPInfo: its type
from merak.tensor_parallel.overlap.levels import check_overlap_args
from merak.tensor_parallel.plans.options import TensorParallelOptions
from merak.tensor_parallel.plans.tp_plan import as_tp_plan, plan_refusal


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext | None = None,
                          options: TensorParallelOptions | None = None, **fields) -> nn.Module:
    """Shard `model` for this rank's place in the TP group of `ctx` (default: `merak.init`'s).

    `options` (`TensorParallelOptions`, or its fields by name: ``plan=``, ``parallel_vocab=``,
    ...): the plan is ``options.plan`` when given (a `TPPlan`, or a dict of
    `merak.set_tp_layer_lists`' arguments), else the one `set_tp_layer_lists` recorded for the
    job (``ctx.tp_plan``), else the family's, else the config's ``base_model_tp_plan``
    (`apply.choice.plan_for`). ``overlap_level`` and ``overlap_sub_batches`` (sub-pipelined TP,
    ``tp_overlapping_level``) are passed to `merak.tensor_parallel.overlap.levels.set_tp_overlap`
    once the model is converted.

    Raises:
        ValueError: tp does not divide a head count or size (the error names the attribute), the
            model has no plan (the error names `merak.set_tp_layer_lists`), `plan` is invalid,
            sequence parallelism is asked for a family whose plan does not support it, or the
            overlap arguments are invalid (level not 0-2, overlap_sub_batches < 2, with
            sequence parallelism or tp=1); checked before the model is touched.
    """
    o = given(TensorParallelOptions, options, fields, "apply_tensor_parallel")
    check_overlap_args(o.overlap_level, o.overlap_sub_batches,
                       sequence_parallel=o.sequence_parallel)
    plan = as_tp_plan(o.plan)
    ctx = ctx or get_context()
    if getattr(model, "merak_tp", None) is not None:
        raise ValueError("this model is already tensor-parallel")
    tp = ctx.tp
    if tp == 1:
        if o.sequence_parallel:
            raise ValueError("sequence_parallel splits the sequence across tensor-parallel "
                             "ranks and needs tp > 1; set sequence_parallel=False")
        if o.overlap_level:
            raise ValueError("overlap_level overlaps tensor-parallel all-reduces and needs "
                             "tp > 1; set overlap_level=0")
        return model  # parallel_vocab over one rank is the plain vocabulary
    plan = plan_for(model, ctx, plan)
    config = getattr(model, "config", None)
    reason = plan_refusal(config, plan, tp, o.parallel_vocab)
    if reason:
        raise ValueError(reason)
    if plan.source == "inferred" and plan.notes:
        family = getattr(config, "model_type", type(model).__name__)
        warnings.warn(f"tensor parallelism of {family} uses the plan inferred from its blocks, "
                      f"which leaves some layers replicated: {'; '.join(plan.notes)[:600]} "
                      f"(`merak tp-plan {family}` prints it)", stacklevel=2)
    return convert(model, ctx, plan, parallel_vocab=o.parallel_vocab,
                   sequence_parallel=o.sequence_parallel, sequence_dim=o.sequence_dim,
                   overlap_level=o.overlap_level, overlap_sub_batches=o.overlap_sub_batches)
