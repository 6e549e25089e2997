"""What the user's own training loop gets back from ``Engine.feed``: one committed step.

    for batch in my_batches:               # this worker's micro-batches, the user's loop
        result = engine.feed(batch)        # None until the batch completes a step
        if result is not None:
            log(result.step, result.loss)
        if engine.done:                    # max_steps reached, or some worker's data ran out
            break
    engine.finish()                        # end of this worker's data (every rank calls it)

``Engine.fit`` is this loop over an iterable."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepResult:
    """A committed step: the fields of its ``engine.history`` entry (docs/api.md)."""

    step: int  # committed steps so far (local-step strategies: this worker's inner steps)
    loss: float  # mean loss of the step's micro-batches (sharded: over every worker's)
    lr: float
    samples: int  # samples in the step (sharded: every worker's; local steps: this worker's)
    micro_batches: int  # this worker's micro-batches in the step
    global_micro_batches: int | None  # every worker's (None for a local step)
    wire_bytes: int  # bytes this worker sent for the step
    time_s: float  # wall seconds since the previous step committed (or since the loop started)
    grad_norm: float | None
    skipped: bool  # a non-finite gradient or update: parameters and optimizer state unchanged
    bad_ranks: list[int]
    rounds: int  # rounds finished for this step
    min_micro_batches: int  # the pacer's least micro-batches per round at that step
    extra: dict[str, Any] = field(default_factory=dict)  # any other entry fields (local steps: 'outer')

    @classmethod
    def from_entry(cls, entry: dict) -> "StepResult":
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in entry.items() if k in known},
                   extra={k: v for k, v in entry.items() if k not in known})

    def as_dict(self) -> dict:
        """The history entry again (the same keys and values)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**out, **self.extra}
