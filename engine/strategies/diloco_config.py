"""The ``diloco`` section: what only diloco reads (its outer SGD and the pseudo-gradient's wire
dtype; docs/local_steps.md, "The outer round"). The shared local-step settings are the ``outer`` section
(outer_config.py). No torch and no runtime here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Rule, choice, number, setting

OUTER_MOMENTUM_KINDS = ("nesterov", "heavy_ball")
PSEUDO_GRAD_DTYPES = ("float32", "bfloat16")


@dataclass
class DilocoConfig:
    """diloco's outer step: SGD with momentum on the averaged pseudo-gradient."""

    outer_momentum: float = setting(0.9, "momentum of the outer SGD (DiLoCo's 0.9; 0 = none)")
    outer_momentum_kind: str = setting("nesterov", "outer momentum: nesterov (DiLoCo) or heavy_ball")
    pseudo_grad_dtype: str = setting("float32", "dtype of the pseudo-gradient average on the wire")

    RULES: ClassVar[dict[str, Rule]] = {
        "outer_momentum": number(0, 1, high_open=True),
        "outer_momentum_kind": choice(OUTER_MOMENTUM_KINDS),
        "pseudo_grad_dtype": choice(PSEUDO_GRAD_DTYPES),
    }
