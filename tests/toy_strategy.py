"""A toy strategy that reads its own section (tests/toy_section.py): zero1's rounds, plus the
section's settings, which it keeps (tests/engine/test_strategy_sections.py)."""

from __future__ import annotations

from engine.strategies.zero1 import Zero1


class ToyZero1(Zero1):
    sections = ("toy",)  # the config sections it reads

    def __init__(self, factor: float = 1.0, mode: str = "plain") -> None:
        self.factor, self.mode = factor, mode

    @classmethod
    def from_config(cls, cfg) -> "ToyZero1":
        return cls(cfg.toy_factor, cfg.toy_mode)
