"""Which tensor-parallel plan shards a model: the one given, the one recorded, the family's
(Merak's table, the config's ``base_model_tp_plan``), or the one inferred from its blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import nn

from merak.tensor_parallel.plans.hf_styles import plan_fields_from_hf
from merak.tensor_parallel.plans.tp_plan import (
    DIVISIBLE_CONFIG_ATTRS,
    FAMILY_PLANS,
    TPPlan,
    as_tp_plan,
    plan_refusal,
    registered_plan,
)


def _from_config_plan(config) -> TPPlan | None:
    """A plan from the config's own ``base_model_tp_plan`` (every transformers style, see
    `merak.tensor_parallel.plans.hf_styles`); None when it has none or it splits nothing."""
    table = getattr(config, "base_model_tp_plan", None) or {}
    if not table and hasattr(config, "get_text_config"):
        try:
            table = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
        except ValueError:  # several text configs: ambiguous
            table = {}
    fields = plan_fields_from_hf(table, getattr(config, "model_type", "?")) if table else None
    return TPPlan(**fields) if fields else None


def config_plan(config) -> TPPlan | None:
    """The plan of the family `config` describes (Merak's table entry, else the config's
    ``base_model_tp_plan``), or None."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILY_PLANS:
        return FAMILY_PLANS[model_type]
    return _from_config_plan(config)


def plan_for(model: nn.Module, ctx: object = None,
             plan: TPPlan | Mapping | None = None) -> TPPlan:
    """The plan to shard `model` with: `plan` when given (see `as_tp_plan`), else the one
    recorded by `merak.set_tp_layer_lists` for the job of `ctx` (`registered_plan`), else the
    family's table entry, else the config's ``base_model_tp_plan``, else the plan inferred from
    its blocks for ``ctx.tp`` ranks (`merak.tensor_parallel.apply.infer`); when inference places
    nothing, an error with its reasons and naming `merak.set_tp_layer_lists`. A table or config
    plan that does not support this config's variant (``unsupported``: Falcon's multi-query
    attention) or that needs tp to divide a count of 1 (DeepSeek-V4's one K/V head) gives way
    to the inferred plan when inference places something, its notes saying why (a tp that does
    not divide a larger count stays an error: choose another tp)."""
    chosen = as_tp_plan(plan)
    if chosen is None and ctx is not None:
        chosen = registered_plan(ctx)
    if chosen is not None:
        return chosen
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    found = config_plan(config) if config is not None else None
    tp, device = getattr(ctx, "tp", 2), getattr(ctx, "device", "cpu")
    refused = found.unsupported(config) if found is not None and found.unsupported else None
    if found is not None and refused is None:  # or a count no tp > 1 divides (one K/V head)
        refused = plan_refusal(config, found, tp) if any(
            getattr(config, a, None) == 1 for a in DIVISIBLE_CONFIG_ATTRS + found.divisible) \
            else None
    if found is not None and refused is None:
        return found
    from merak.tensor_parallel.apply.infer import infer_plan

    try:
        inferred = infer_plan(model, tp, device)
    except ValueError as error:
        if found is not None:  # the plan's own refusal is the better error
            return found
        raise ValueError(
            f"no tensor-parallel plan for {type(model).__name__} (model_type {model_type!r}; "
            f"{error}): describe its layers with merak.set_tp_layer_lists(col_para_list=[...],"
            f" row_para_list=[...], tp_attr_list=[...]) or a tp_plan, or use tp=1") from error
    if found is None:
        return inferred
    note = f"the family's plan ({found.source}) cannot shard this config: {refused}"
    return dataclasses.replace(inferred, notes=(note, *inferred.notes))

