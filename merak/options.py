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


def given(cls: type[T], options: T | None, fields: dict[str, Any], where: str) -> T:
    """`options` (default: ``cls()``) with `fields` replaced: what an entry point `where` was
    given as an object, as fields by name, or both (the fields win).

    Raises:
        TypeError: `options` is not a `cls`, or a field is not one of `cls`'s (the error lists
            them).
    """
    if options is not None and not isinstance(options, cls):
        raise TypeError(f"{where} takes a {cls.__name__} as its options, got "
                        f"{type(options).__name__}")
    names = field_names(cls)
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {unknown}; the options of {where} are "
                        f"{cls.__name__}'s fields: {', '.join(names)}")
    base = options if options is not None else cls()
    return dataclasses.replace(base, **fields) if fields else base
