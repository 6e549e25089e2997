"""The ``acco`` section: ACCO's delay corrections (acco_loco/delay.py, docs/design/rounds.md),
read by strategy acco. At the defaults the step is ACCO as published (Nabli et al., arXiv
2406.02613). No torch and no runtime here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Rule, choice, integer, number, setting


@dataclass
class AccoConfig:
    """What ACCO does about its stale half (the gradient accumulated on the estimate)."""

    delay_compensation: float = setting(0.0, "DC-ASGD's lambda (Zheng et al. 2017): add lambda * g * g * "
                                        "(theta_t - estimate) to the stale half's mean g; 0 = off (ACCO as "
                                        "published)")
    weight_prediction: float = setting(0.0, "s > 0: the estimate round sends theta_t + s * (the last committed "
                                       "update) instead of ACCO's half-batch step (weight prediction, "
                                       "PipeDream-2BW/SpecTrain); 0 = off (ACCO as published)")
    sync_steps: int = setting(0, "the first N optimizer steps run without overlap: each round waits for the one "
                              "before it and the estimate round installs theta_t, so those steps are zero1's "
                              "update of the whole batch (the ACCO authors' n_warmup_steps); 0 = off")
    estimate_clip: str = setting("half", "which norm clips the estimate round's step (with max_grad_norm): 'half' its "
                                 "own half-batch gradient's (ACCO as published), 'step' the last committed "
                                 "step's whole-batch gradient's (the estimate is then scaled as the step before "
                                 "it was; a probe of issue 43)")

    RULES: ClassVar[dict[str, Rule]] = {
        "delay_compensation": number(0),
        "weight_prediction": number(0),
        "sync_steps": integer(0),
        "estimate_clip": choice(("half", "step")),
    }
