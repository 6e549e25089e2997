"""What the user wants from the choice of strategy: the one setting both ``strategy="auto"``
(engine/auto.py) and the planner's recommendation (``python -m engine.plan``) decide by
(engine/planner/decide.py, docs/planning.md "The decision rule").

- ``loss_per_sample`` (the default): keep AdamW's loss per sample: the fastest mode whose measured
  held-out loss at equal samples is within ``loss_bound_pct`` percent of torch DDP's (AdamW);
- ``time_to_loss``: reach AdamW's loss soonest: the least predicted time per sample x the measured
  samples the mode needs to reach AdamW's loss over AdamW's own.

The defaults live here and nowhere else: EngineConfig's ``auto_goal`` / ``auto_loss_bound_pct``
and the planner's ``--goal`` / ``--loss-bound`` take them from this file."""

from __future__ import annotations

import math
from dataclasses import dataclass

GOALS = ("loss_per_sample", "time_to_loss")
DEFAULT_GOAL = "loss_per_sample"
DEFAULT_LOSS_BOUND_PCT = 0.5  # percent of AdamW's held-out loss at equal samples
# the optimizer the run steps with: its loss figures are measured against torch DDP with the same
# one (EngineConfig's optimizer; Muon's JSONs: docs/acco_delay.md)
OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon", "sgd": "SGD"}


@dataclass(frozen=True)
class Goal:
    kind: str = DEFAULT_GOAL
    loss_bound_pct: float = DEFAULT_LOSS_BOUND_PCT  # read by loss_per_sample only
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.kind not in GOALS:
            raise ValueError(f"goal {self.kind!r}: choose one of {GOALS} (loss_per_sample keeps AdamW's loss per "
                             "sample within a bound; time_to_loss reaches AdamW's loss soonest)")
        if not (isinstance(self.loss_bound_pct, (int, float)) and math.isfinite(self.loss_bound_pct)
                and self.loss_bound_pct >= 0):
            raise ValueError(f"loss bound {self.loss_bound_pct!r}: give a percentage >= 0 (e.g. 0.5 for "
                             "within 0.5% of AdamW's held-out loss)")
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ValueError(f"optimizer {self.optimizer!r}: choose one of {tuple(OPTIMIZER_NAMES)} (the optimizer the "
                             "run steps with; its loss figures are measured against torch DDP with the same one)")

    def describe(self) -> str:
        opt = OPTIMIZER_NAMES[self.optimizer]
        if self.kind == "loss_per_sample":
            return (f"keep {opt}'s loss per sample (held-out loss at equal samples within "
                    f"+{self.loss_bound_pct:g}% of torch DDP's" + ("" if opt == "AdamW" else f" with {opt}")
                    + "), then the fastest")
        return (f"reach {opt}'s loss soonest (predicted time per sample x the measured samples to {opt}'s loss"
                + ("" if opt == "AdamW" else " with torch DDP") + ")")
