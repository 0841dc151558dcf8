"""Numbers and files given on the command line, checked before anything runs.

Each `merak` command declares its numbers with these argparse types (a value out of range
makes argparse stop with a one-line reason and exit status 2), and raises `InputError` for what
only shows once the arguments are read together (a file that is not JSON, a product of sizes
too large to simulate): `merak`'s main prints it on one line and exits with status 2 too.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


class InputError(ValueError):
    """A command's input is invalid: `merak` exits with status 2 and this one-line reason."""


def _number(text: str, kind: type, minimum: float | None, strict: bool, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    if minimum is not None and (value < minimum or (strict and value == minimum)):
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 0, True, "must be an integer >= 1")


def non_negative_int(text: str) -> int:
    return _number(text, int, 0, False, "must be an integer >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, 0.0, True, "must be a finite number > 0")


def non_negative_float(text: str) -> float:
    return _number(text, float, 0.0, False, "must be a finite number >= 0")


def finite_float(text: str) -> float:
    return _number(text, float, None, False, "must be a finite number")


def non_negative_floats(text: str) -> float | list[float]:
    """One finite number >= 0, or comma-separated ones (one per stage)."""
    values = [_number(v, float, 0.0, False, "must be finite numbers >= 0 (comma-separated)")
              for v in text.split(",")]
    return values[0] if len(values) == 1 else values


def positive_ints(text: str) -> list[int]:
    """Comma-separated integers >= 1."""
    return [_number(v, int, 0, True, "must be integers >= 1 (comma-separated)")
            for v in text.split(",")]


def read_json(path: str | Path, what: str) -> object:
    """The JSON in file `path` (`what` it should hold, for the message), or `InputError`
    saying why not."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise InputError(f"cannot read {what} {path}: {error.strerror or error}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"{what} {path} is not JSON: {error.msg} at line {error.lineno}, "
                         f"column {error.colno}") from None


def check_work(what: str, units: int, limit: int, fix: str) -> None:
    """`InputError` when a request would take more than `limit` units of work (its time and
    memory grow with them), before any is done."""
    if units > limit:
        raise InputError(f"{what} = {units:,} is more than the {limit:,} this command handles "
                         f"in reasonable time and memory; {fix}")
