"""The ``onebit`` section: the settings of 1-bit Adam (strategy onebit_adam,
docs/onebit_adam.md), which reads it (its class attribute ``sections``). Registered by name in
engine/strategies/__init__.py ``SECTIONS``; no torch and no runtime here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Rule, integer, number, optional, setting


@dataclass
class OnebitConfig:
    """AdamW until the second moment is frozen, then the momentum travels as 1 bit a value each way."""

    onebit_warmup_steps: int | None = setting(None, "AdamW steps before the second moment is frozen; none = "
                                              "when it has stabilised (onebit_window, onebit_tolerance, "
                                              "onebit_min_warmup, onebit_max_warmup_fraction)")
    onebit_window: int = setting(10, "variance rule: compare the L1 norm of the bias-corrected second moment "
                                 "with its value this many AdamW steps earlier")
    onebit_tolerance: float = setting(0.05, "variance rule: freeze once that norm moved by at most this "
                                      "fraction over the window")
    onebit_min_warmup: int = setting(20, "variance rule: never freeze before this many AdamW steps")
    onebit_max_warmup_fraction: float = setting(0.25, "variance rule: freeze at the latest after this "
                                                "fraction of max_steps")

    # one rule per field (engine/rules.py): EngineConfig checks every value with it
    RULES: ClassVar[dict[str, Rule]] = {
        "onebit_warmup_steps": optional(integer(1), "the variance rule decides"),
        "onebit_window": integer(1),
        "onebit_tolerance": number(0, low_open=True),
        "onebit_min_warmup": integer(1),
        "onebit_max_warmup_fraction": number(0, 1, low_open=True),
    }
