"""Shard optimizers by config name: the table and the hyper-parameters (no kernels here, so that
the kernels' self-check can build a spec without importing acco_loco/optim.py, which uses them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import adamw, muon, sgd

OPTIMIZERS = {"adamw": adamw, "sgd": sgd, "muon": muon}  # name -> module with init_state and propose
MUON_ADJUST_LR = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn


@dataclass(frozen=True)
class OptimizerSpec:
    """Hyper-parameters of the shard optimizer (the learning rate comes per step)."""

    name: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only
    # muon only (its matrices; every other value takes AdamW's step with betas/eps above):
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    # "match_rms_adamw": the update's RMS matched to AdamW's, so one lr serves both (Moonlight)
    muon_adjust_lr: str = "match_rms_adamw"

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
        if not (finite_number(self.muon_momentum) and 0.0 <= self.muon_momentum < 1.0):
            raise ValueError(f"muon_momentum must be a finite number in [0, 1), got {self.muon_momentum!r}")
        if not isinstance(self.muon_nesterov, bool):
            raise ValueError(f"muon_nesterov must be True or False, got {self.muon_nesterov!r}")
        if isinstance(self.muon_ns_steps, bool) or not isinstance(self.muon_ns_steps, int) or self.muon_ns_steps < 1:
            raise ValueError(f"muon_ns_steps must be an integer >= 1, got {self.muon_ns_steps!r}")
        if self.muon_adjust_lr not in MUON_ADJUST_LR:
            raise ValueError(f"muon_adjust_lr must be one of {MUON_ADJUST_LR}, got {self.muon_adjust_lr!r}")


def finite_number(value) -> bool:
    """An int or float (not a bool) that is finite as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
