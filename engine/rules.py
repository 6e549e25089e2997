"""The building blocks of EngineConfig's settings: ``setting`` (a field's default and help) and
the per-field rules, each of which checks one value and says what is allowed in its error message.
Each section holds its table, one rule per field (engine/sections.py for the core sections, a
strategy's section file for its own); a section file imports nothing of the runtime but this."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from acco_loco.optim import finite_number as _finite

Rule = Callable[[str, Any], None]  # (field name, value) -> None, or raises ValueError


def setting(default: Any, help: str) -> Any:
    """A config field with its default and the one-line help that the recipes' flags show."""
    return dataclasses.field(default=default, metadata={"help": help})


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Check:
    """What one field accepts: ``ok`` decides, ``allowed`` says it in the error message."""

    allowed: str
    ok: Callable[[Any], bool]

    def __call__(self, name: str, value: Any) -> None:
        if not self.ok(value):
            raise ValueError(f"{name} must be {self.allowed}, got {value!r}")


def integer(minimum: int) -> Check:
    """An int (not a bool, not a float) >= minimum."""
    allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    return Check(allowed, lambda v: is_int(v) and v >= minimum)


def number(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False,
           note: str = "") -> Check:
    """A finite int or float (not a bool) in the interval; ``note`` says what a value means."""
    if high == math.inf:
        allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        allowed = f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if note:
        allowed += f" ({note})"

    def ok(v: Any) -> bool:
        return (_finite(v) and (v > low if low_open else v >= low)
                and (v < high if high_open else v <= high))

    return Check(allowed, ok)


def optional(rule: Check, none_means: str) -> Check:
    return Check(f"None ({none_means}) or {rule.allowed}", lambda v: v is None or rule.ok(v))


@dataclass(frozen=True)
class Choice:
    """One of a closed set of names (the recipes' flags list ``options``)."""

    options: tuple[str, ...]

    def __call__(self, name: str, value: Any) -> None:
        if not isinstance(value, str) or value not in self.options:
            raise ValueError(f"unknown {name} {value!r}: choose one of {self.options}")


def choice(options: tuple[str, ...] | list[str]) -> Choice:
    return Choice(tuple(options))


boolean = Check("True or False (a bool, not 0/1 or a string)", lambda v: isinstance(v, bool))
