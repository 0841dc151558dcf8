"""Options objects: each layer's settings as one frozen dataclass, passed whole.

`merak.auto_split` takes a `SplitOptions`, `merak.apply_tensor_parallel` a
`TensorParallelOptions`, `merak.PipelineInterpreter` a `RuntimeOptions`, and `build_engine`
an `EngineOptions` made of them. Each entry point also takes the fields of its options by name
(``auto_split(model, batch, 2, trace_method="fx")``), which `given` turns into the object.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def field_names(cls: type) -> tuple[str, ...]:
    """The field names of the options dataclass `cls`."""
    return tuple(f.name for f in dataclasses.fields(cls))


def by_class(fields: dict[str, Any], classes: list[type], where: str) -> list[dict[str, Any]]:
    """`fields` split among the options dataclasses `classes` by the field names each declares
    (in that order: a name two declare goes to the first).

    Raises:
        TypeError: a field none of them declares (the error lists each class's fields).
    """
    parts, left = [], dict(fields)
    for cls in classes:
        names = field_names(cls)
        parts.append({k: left.pop(k) for k in list(left) if k in names})
    if left:
        known = " and ".join(f"{cls.__name__}' fields ({', '.join(field_names(cls))})"
                             for cls in classes)
        raise TypeError(f"{where} got unknown option(s) {sorted(left)}; its options are {known}")
    return parts


def given(cls: type[T], options: T | None, fields: dict[str, Any], where: str) -> T:
    """`options` (default: ``cls()``) with `fields` replaced: what an entry point `where` was
    given as an object, as fields by name, or both (the fields win).

    Raises:
        TypeError: `options` is not a `cls`, or a field is not one of `cls`'s (`by_class`).
    """
    if options is not None and not isinstance(options, cls):
        raise TypeError(f"{where} takes a {cls.__name__} as its options, got "
                        f"{type(options).__name__}")
    [mine] = by_class(fields, [cls], where)
    base = options if options is not None else cls()
    return dataclasses.replace(base, **mine) if mine else base
