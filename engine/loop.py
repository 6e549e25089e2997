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
    """A committed step: the fields of its ``engine.history`` entry (docs/DESIGN.md section 2)."""

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


def done_message(step: int, max_steps: int, stop_at: int) -> str:
    """Why a loop takes no more batches (what ``feed`` after ``done`` says)."""
    if step >= max_steps:
        return (f"the engine is at step {step}, its max_steps: nothing more to train (load it with "
                f"a new horizon to continue: Engine.load(directory, model, max_steps=...))")
    if step >= stop_at:
        return f"this loop's steps are done at step {step}: begin(steps) starts another piece"
    return (f"training stopped at step {step}: the data of some worker ran out; begin() and "
            f"feed() again on every rank to continue with more data")


def loop_end(step: int, max_steps: int, steps: int | None) -> int:
    """The step at which a loop started at ``step`` ends: ``steps`` more, at most ``max_steps``."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive integer or None, got {steps!r}")
    if step >= max_steps:
        raise RuntimeError(
            f"the engine is at step {step}, its max_steps is {max_steps}: nothing to "
            f"train. To continue a saved run, load it with a new horizon: "
            f"Engine.load(directory, model, loss_fn=..., max_steps={step + max_steps})")
    return max_steps if steps is None else min(max_steps, step + steps)
