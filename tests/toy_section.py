"""A toy strategy section, as a strategy from outside the package would bring it: a dataclass of
``setting(...)`` fields with its RULES table, importing neither torch nor the runtime. It is
registered with its strategy (tests/toy_strategy.py) by two registry lines:

    engine.strategies.SECTIONS["toy"] = "tests.toy_section:ToyConfig"
    engine.strategies.STRATEGIES["toy_zero1"] = "tests.toy_strategy:ToyZero1"

(tests/engine/test_strategy_sections.py adds them for a test and takes them out again)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine.rules import Rule, choice, number, setting


@dataclass
class ToyConfig:
    """What the toy strategy reads."""

    toy_factor: float = setting(1.0, "the toy's factor")
    toy_mode: str = setting("plain", "the toy's mode: plain or fancy")

    RULES: ClassVar[dict[str, Rule]] = {
        "toy_factor": number(0, 1, low_open=True),
        "toy_mode": choice(("plain", "fancy")),
    }


@dataclass
class UnruledConfig:
    """A section whose RULES forget a field: refused at its first use."""

    toy_forgotten: int = setting(1, "a field without a rule")

    RULES: ClassVar[dict[str, Rule]] = {}


@dataclass
class ClashingConfig:
    """A section with a field whose flat name is taken (the core section's lr)."""

    lr: float = setting(1.0, "a second lr")

    RULES: ClassVar[dict[str, Rule]] = {"lr": number(0)}
