"""Shard optimizers by config name: the table and the hyper-parameters (no kernels here, so that
the kernels' self-check can build a spec without importing acco_loco/optim.py, which uses them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import adamw, sgd

OPTIMIZERS = {"adamw": adamw, "sgd": sgd}  # name -> module with init_state and propose


@dataclass(frozen=True)
class OptimizerSpec:
    """Hyper-parameters of the shard optimizer (the learning rate comes per step)."""

    name: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only

    def __post_init__(self) -> None:
        # NaN fails every comparison, so each range check asks for finite numbers first
        if not isinstance(self.name, str) or self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}: choose one of {tuple(OPTIMIZERS)}")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(finite_number(b) and 0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got {self.betas!r}")
        if not (finite_number(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps!r}")
        if not (finite_number(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not (finite_number(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum must be a finite number in [0, 1), got {self.momentum!r}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {self.nesterov!r}")


def finite_number(value) -> bool:
    """An int or float (not a bool) that is finite as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
