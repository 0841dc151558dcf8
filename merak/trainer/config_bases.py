"""`MerakArguments` combined with another `TrainingArguments` subclass (TRL's `SFTConfig`,
any project's config), in either base order, keeping each field's default from the class that
declared it.

A dataclass takes its fields from its bases' ``__dataclass_fields__`` in reverse MRO order, and
each dataclass base carries *every* field it inherited. So in ``@dataclass class
C(MerakArguments, SFTConfig)`` the fields `MerakArguments` inherited from `TrainingArguments`
(with `TrainingArguments`' defaults) come last and replace `SFTConfig`'s own defaults
(``learning_rate``, ``logging_steps``, ``gradient_checkpointing``, ...); in the other order
`SFTConfig`'s copies replace the defaults `MerakArguments` changed. `keep_declared_defaults`,
run from ``MerakArguments.__init_subclass__`` (before the subclass's ``@dataclass`` runs),
redeclares on the subclass each field whose default would otherwise not come from the nearest
class in the MRO that declares it in its own body.
"""

from __future__ import annotations

import dataclasses


def _declared(cls: type) -> dict[str, dataclasses.Field]:
    """name -> the field of the nearest class after `cls` in its MRO that declares it."""
    out: dict[str, dataclasses.Field] = {}
    for klass in cls.__mro__[1:]:
        if "__dataclass_fields__" not in klass.__dict__:
            continue
        fields = {f.name: f for f in dataclasses.fields(klass)}  # no ClassVar / InitVar
        for name in klass.__dict__.get("__annotations__", {}):
            if name in fields and name not in out:
                out[name] = fields[name]
    return out


def _picked(cls: type) -> dict[str, dataclasses.Field]:
    """name -> the field `dataclass` would give `cls` from its bases (reverse MRO order)."""
    out: dict[str, dataclasses.Field] = {}
    for klass in reversed(cls.__mro__[1:]):
        out.update(klass.__dict__.get("__dataclass_fields__", {}))
    return out


def keep_declared_defaults(cls: type) -> list[str]:
    """Redeclare on `cls` the fields whose inherited default is not the declaring class's;
    returns their names. Fields `cls` declares itself are left alone."""
    own = cls.__dict__.get("__annotations__")
    if own is None:
        own = {}
        cls.__annotations__ = own
    picked, changed = _picked(cls), []
    for name, field in _declared(cls).items():
        if name in own or picked.get(name) is field:
            continue
        own[name] = field.type
        setattr(cls, name, dataclasses.field(
            default=field.default, default_factory=field.default_factory, init=field.init,
            repr=field.repr, hash=field.hash, compare=field.compare, metadata=field.metadata))
        changed.append(name)
    return changed
