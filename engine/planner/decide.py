"""The one decision rule: which mode a run should use, for the user's goal (goal.py), with the
reasons and the evidence each number stands on. ``strategy="auto"`` (engine/auto.py) and the
planner's recommendation (recommend.make_plan, ``python -m engine.plan``) both call ``decide`` on
the planner's rows (docs/planning.md, "The decision rule").

The rule, in order:

1. the pool: the modes a run of the engine can take (never torch DDP, the reference), AdamW's update
   or AdamW's one step late with its correction (``auto_strategies``: never a local-step method, never
   1-bit Adam, never the uncorrected stale update, ``StrategySpec.stale_update``), and that the run's layout
   settings run (``runnable``: the exchange its topology resolves to, its model sharding, where its
   optimizer steps);
2. measured: the figure the goal needs has qualifying rows of the mode's own (evidence.py: >= 3
   seeds of a benchmark JSON or of the loss grid); a mode without them is shown "not measured"
   and never chosen;
3. the goal: ``loss_per_sample`` keeps the modes whose loss per sample, at the run's B and length,
   is within the bound of AdamW's; ``time_to_loss`` keeps them all;
4. fits the GPU's memory with its activations;
5. the least predicted seconds per sample (``time_to_loss``: times the samples factor); modes
   within 3% count as equal and the simplest of them is taken (fewest lossy codecs, then rounds,
   no overlap, a flat exchange, no model sharding)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.parallel.topology import Layout, exchange_for
from engine.strategies import strategy_class

from .goal import OPTIMIZER_NAMES, Goal
from .modes import Mode, auto_strategies

TIE = 0.03  # modes within 3% of the best count as equal
MAX_LEFT_OUT = 6  # faster modes named in the reasons


def candidate_strategies() -> tuple[str, ...]:
    """The strategies the decision rule may choose, in the planner's recommendation and in
    strategy="auto" (engine/auto.py): AdamW's update or AdamW's one step late with a correction
    (a stale update with none is left out: ``StrategySpec.stale_update``)."""
    return tuple(s for s in auto_strategies() if not strategy_class(s).spec().stale_update)


def in_pool(mode: Mode) -> bool:
    """Whether the rule may choose ``mode``: strategy="auto"'s strategies."""
    return not mode.is_ddp and mode.strategy in candidate_strategies()


def runnable(mode: Mode, layout: Layout, topology: str = "auto", model_sharding: str | None = None,
             optimizer_offload: str | None = None) -> bool:
    """Whether a run on ``layout`` with these settings (EngineConfig's) runs ``mode``'s exchange,
    model sharding and optimizer placement (None: either; torch DDP: always, it is the reference)."""
    if mode.is_ddp:
        return True
    exchange = exchange_for(topology, layout).replace("_", "-")
    return (mode.exchange == exchange and (model_sharding is None or mode.sharding == model_sharding)
            and (optimizer_offload is None or mode.offload == optimizer_offload))


def simplicity(m: Mode) -> tuple:
    lossy = (m.codec != "none") + (m.param_codec in ("int8", "int4"))
    return (lossy, m.rounds, m.overlap, m.exchange != "flat", m.sharding != "none", m.offload != "none")


@dataclass(frozen=True)
class Decision:
    goal: Goal
    choice: object | None  # the chosen PlanRow (recommend.py), None when none qualifies
    why: str


def time_to_loss(step_s: float, factor: float, warmup_fraction: float | None = None,
                 warmup_step_s: float | None = None) -> float:
    """Seconds per AdamW-step-equivalent of progress to AdamW's loss: the mode needs ``factor``
    times AdamW's samples, its first ``warmup_fraction`` of AdamW's steps (1-bit Adam's warmup)
    at ``warmup_step_s``."""
    w = warmup_fraction or 0.0
    if w and warmup_step_s is not None:
        return w * warmup_step_s + max(0.0, factor - w) * step_s
    return factor * step_s


def score(row, goal: Goal) -> float:
    """Seconds per sample (loss_per_sample) or seconds per AdamW-sample of progress (time_to_loss)."""
    per_sample = row.time.step_s / row.samples_per_step
    if goal.kind == "time_to_loss":
        warm = row.warmup_step_s / row.samples_per_step if row.warmup_step_s else None
        return time_to_loss(per_sample, row.factor.value, row.warmup_fraction, warm)
    return per_sample


def _figure(row, goal: Goal):
    return row.factor if goal.kind == "time_to_loss" else row.loss


def loss_text(row, opt: str = "AdamW") -> str:
    """The row's loss per sample (against torch DDP with the optimizer ``opt``) with the B and
    length of its evidence, its sources and where the run lies outside them."""
    est = row.loss
    if est.reference:
        return f"loss per sample: the reference ({opt})"
    if not est.measured:
        return "loss per sample: " + est.not_measured()
    out = (f"loss per sample {est.value:+.2f}% vs {opt} at {est.evidence().replace('; beyond', '')} "
           f"[{est.sources()}]")
    return out + (f"; {est.beyond}" if est.beyond else "") + (f"; {est.note}" if est.note else "")


def factor_text(row, opt: str = "AdamW") -> str:
    est = row.factor
    if est.reference:
        return f"samples to {opt}'s loss: 1x (the reference)"
    if not est.measured:
        return f"samples to {opt}'s loss: " + est.not_measured()
    return (f"samples to {opt}'s loss {est.value:.2f}x {opt}'s at {est.evidence().replace('; beyond', '')}"
            + (f" ({est.beyond})" if est.beyond else ""))


def _rejection(row, goal: Goal) -> str | None:
    """Why a pool row is not eligible, or None when it is."""
    est = _figure(row, goal)
    if not est.measured:
        return est.not_measured()
    if goal.kind == "loss_per_sample" and est.value > goal.loss_bound_pct:
        return f"{est.value:+.2f}% > +{goal.loss_bound_pct:g}% at {est.evidence()}"
    if not row.fits:
        return f"does not fit ({row.total_bytes / 2**30:.3g} GiB per GPU)"
    return None


def decide(rows: list, goal: Goal, pool: Callable[[Mode], bool] = in_pool,
           list_faster: int = MAX_LEFT_OUT) -> Decision:
    """The rule of the module over ``rows`` (recommend.PlanRow: time, samples per step, fits, loss
    and factor estimates); the reasons name up to ``list_faster`` faster modes it left out, and why."""
    pool_rows = [r for r in rows if pool(r.mode)]
    if not pool_rows:
        return Decision(goal, None, f"Goal: {goal.describe()}. No candidate mode to decide between.")
    eligible = [r for r in pool_rows if _rejection(r, goal) is None]
    head, opt = f"Goal: {goal.describe()}. ", OPTIMIZER_NAMES[goal.optimizer]
    if not eligible:
        unfit = [r for r in pool_rows if _figure(r, goal).measured and r.fits is False
                 and (goal.kind != "loss_per_sample" or _figure(r, goal).value <= goal.loss_bound_pct)]
        if unfit:
            least = min(unfit, key=lambda r: r.total_bytes)
            return Decision(goal, None, head + (
                f"No measured mode that meets the goal fits: the smallest, {least.mode.name}, needs "
                f"{least.total_bytes / 2**30:.3g} GiB per GPU ({least.memory.total / 2**30:.3g} GiB of state, "
                f"{least.activations / 2**30:.3g} GiB of activations"
                + (", checkpointed" if least.checkpointing else "") + ")."))
        return Decision(goal, None, head + "No mode meets it: " + "; ".join(
            f"{r.mode.name}: {_rejection(r, goal)}" for r in pool_rows[:MAX_LEFT_OUT]) + ".")
    best = min(score(r, goal) for r in eligible)
    near = [r for r in eligible if score(r, goal) <= best * (1 + TIE)]
    choice = min(near, key=lambda r: (simplicity(r.mode), score(r, goal)))
    t = choice.time
    bound = "the link" if t.exposed_s > 0.05 * t.step_s else "compute"
    vs_ddp = f", {choice.speedup_vs_ddp:.2f}x torch DDP's step" if choice.speedup_vs_ddp else ""
    why = head + (f"{choice.mode.name}: predicted {t.step_s:.3g} s/step for {choice.samples_per_step} samples"
                  f"{vs_ddp} (compute {t.compute_s:.3g} s, node link "
                  f"{t.inter_s:.3g} s, inside the node {t.intra_s:.3g} s, comm-side work {t.comm_work_s:.3g} s, "
                  f"exposed {t.exposed_s:.3g} s: bound by {bound}); {choice.memory.total / 2**30:.3g} GiB of state "
                  f"and {choice.activations / 2**30:.3g} GiB of activations per GPU"
                  + (" (activation checkpointing: needed to fit)" if choice.checkpointing else "") + ". ")
    if goal.kind == "time_to_loss":
        to_loss = (f"{choice.to_loss_vs_ddp:.2f}x torch DDP's" if choice.to_loss_vs_ddp is not None else
                   f"{score(choice, goal) * 1e3:.3g} ms per sample of {opt}'s progress")
        why += f"Predicted time to {opt}'s loss {to_loss}; {factor_text(choice, opt)}. "
    text = loss_text(choice, opt)
    why += text[0].upper() + text[1:] + ". "
    if len(near) > 1:
        why += f"{len(near) - 1} other mode(s) within {TIE:.0%}: the one with the fewest lossy codecs and rounds. "
    faster = sorted((r for r in pool_rows if r is not choice and _rejection(r, goal) is not None
                     and r.time.step_s / r.samples_per_step < choice.time.step_s / choice.samples_per_step),
                    key=lambda r: r.time.step_s / r.samples_per_step)
    if faster and list_faster:
        why += "Faster but not chosen: " + "; ".join(
            f"{r.mode.name}: {_rejection(r, goal)}" for r in faster[:list_faster]) + \
            (f"; and {len(faster) - list_faster} more" if len(faster) > list_faster else "") + "."
    return Decision(goal, choice, why.strip())
