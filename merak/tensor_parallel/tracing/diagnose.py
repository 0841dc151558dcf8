"""Name the tensor-parallel cause of a shape error raised inside a TP model.

After `apply_tensor_parallel`, a layer's output holds only this rank's part of its features. An
operation of the model that spans the whole width (OLMo2's ``q_norm`` over the full projection,
a reshape with the full head count) then fails with a shape error, during tracing (the pipeline
split) or when the stage runs. `explain_tp_failure` turns that error into a message naming the
TP-converted module nearest the failure, its TP style, the plan it came from and how to
override the plan, instead of a capture hint.
"""

from __future__ import annotations

import inspect
import re
import traceback
from collections.abc import Iterator

from torch import nn

_SHAPE_ERROR = re.compile(
    r"size of tensor a .* must match the size of tensor b|shape '\[.*\]' is invalid for input"
    r"|shapes cannot be multiplied|Attempting to broadcast a dimension|expanded size of the "
    r"tensor|normalized_shape|doesn't match the broadcast shape|Sizes of tensors must match"
    r"|size mismatch|Expected .*shape|mat1 and mat2|Dimension out of range|split_with_sizes"
    r"|not divisible by|ShapeMismatch|shape mismatch|incompatible shapes?"
    r"|must have same reduction dim", re.IGNORECASE)
_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')
_SHOWN = 4


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_shape_error(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) reports mismatching tensor shapes."""
    return any(_SHAPE_ERROR.search(str(e)) for e in _chain(error))


def _frame_modules(error: BaseException, names: dict[int, str]) -> list[str]:
    """Modules of the model whose methods are on the tracebacks, outermost first."""
    found: list[str] = []
    for exc in _chain(error):
        for frame, _ in traceback.walk_tb(exc.__traceback__):
            owner = frame.f_locals.get("self")
            name = names.get(id(owner)) if owner is not None else None
            if name is not None and name not in found:
                found.append(name)
    return found


def _source_modules(error: BaseException, model: nn.Module) -> list[str]:
    """Modules whose forward contains a ``File ..., line N`` of the error texts (the user-code
    frames torch.export and dynamo print): the first instance of each such class."""
    lines = [(f, int(n)) for e in _chain(error) for f, n, _ in _USER_FRAME.findall(str(e))]
    if not lines:
        return []
    found: list[str] = []
    spans: dict[type, tuple[str, int, int] | None] = {}
    for name, module in model.named_modules():
        cls = type(module)
        if cls not in spans:
            try:
                forward = inspect.unwrap(cls.forward)
                source, start = inspect.getsourcelines(forward)
                spans[cls] = (inspect.getsourcefile(forward) or "", start, start + len(source))
            except (OSError, TypeError):
                spans[cls] = None
        span = spans[cls]
        if span and any(f == span[0] and span[1] <= n < span[2] for f, n in lines) \
                and not any(type(model.get_submodule(n)) is cls for n in found if n):
            found.append(name)
    return found


def _within(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def nearest_tp_modules(model: nn.Module, error: BaseException) -> tuple[str | None, list[str]]:
    """(the innermost module of the model on the failure, the TP-converted modules nearest to
    it: itself, else those inside it, else inside its closest ancestor that has any)."""
    info = getattr(model, "merak_tp", None)
    converted = list(info.converted) if info is not None else []
    names = {id(m): n for n, m in model.named_modules()}
    stack = _frame_modules(error, names) or _source_modules(error, model)
    where = max(stack, key=lambda n: n.count(".") + bool(n)) if stack else None
    if where is None:
        return None, []
    scope = where
    while True:
        near = [c for c in converted if _within(c, scope)]
        if near or not scope:
            return where, near
        scope = scope.rpartition(".")[0]


def explain_tp_failure(model: nn.Module, error: BaseException) -> str | None:
    """A message naming the tensor-parallel cause of `error`, or None when `model` is not
    tensor-parallel (no ``model.merak_tp``) or `error` is not a shape error."""
    info = getattr(model, "merak_tp", None)
    if info is None or not is_shape_error(error):
        return None
    first = next((line for line in str(error).strip().splitlines() if line.strip()),
                 type(error).__name__)
    where, near = nearest_tp_modules(model, error)
    plan = info.plan
    lines = [f"a shape error inside the tensor-parallel model {type(model).__name__} (tp="
             f"{info.size}, plan from {_plan_origin(plan.source)}): {first}"]
    if where is not None:
        kind = type(model.get_submodule(where)).__name__ if where else type(model).__name__
        lines.append(f"It happened in {where or '<the model>'} ({kind}); the tensor-parallel "
                     f"modules nearest to it:" if near else
                     f"It happened in {where or '<the model>'} ({kind}).")
    else:
        near = list(info.converted)
        lines.append("Its place is unknown; the model's tensor-parallel modules:")
    for name in near[:_SHOWN]:
        lines.append(f"  {name}: {info.style_of(name)}")
    if len(near) > _SHOWN:
        lines.append(f"  ... and {len(near) - _SHOWN} more")
    lines.append(
        f"Each rank holds 1/{info.size} of a column-parallel layer's output features, so an "
        f"operation over the whole width there (a norm over the full projection, a reshape "
        f"with the full head count) sees only this rank's part. Override the plan: "
        f"merak.set_tp_layer_lists(col_para_list=[...], row_para_list=[...], "
        f"tp_attr_list=[<head counts to divide>]) after merak.init(), or pass a merak.TPPlan "
        f"as MerakArguments(tp_plan=...) / merak.parallelize(..., tp_plan=...) (e.g. "
        f"gather_output=[<column layers whose full output is needed>], split_input=[<the row "
        f"layers after them>]); tp=1 confirms the model itself runs.")
    return "\n".join(lines)


def _plan_origin(source: str) -> str:
    return {"table": "merak's FAMILY_PLANS table",
            "base_model_tp_plan": "the config's base_model_tp_plan",
            "set_tp_layer_lists": "merak.set_tp_layer_lists",
            "inferred": "the plan inferred from the blocks (merak tp-plan)"}.get(source,
                                                                              repr(source))
