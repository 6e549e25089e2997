"""The planner's rows and its recommendation.

``make_plan`` predicts every candidate mode (engine/planner/modes.py) on one cluster and batch;
``recommend`` picks the fastest of the modes that fit the GPU's memory with their activations and
keep synchronous AdamW's loss per sample (torch DDP and the strategies whose spec says their
update is AdamW's, with or without LoCo-4 gradients and int8/int4 parameter deltas; measured in
the results folder where the benchmark ran them) and says why; among modes within 3% of the
fastest it takes the simplest (fewest lossy codecs, then fewest rounds, no overlap, a flat
exchange, no model sharding). It never takes a mode that does not fit: when none does, the plan
has no choice and says what would fit (engine/planner/advice.py).
``recommend_soonest`` answers the other question a user asks: which mode reaches AdamW's loss
first in wall-clock time, whatever its loss per sample, from each mode's measured samples to
that loss (quality.samples_factor) times its predicted step time."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .advice import what_would_fit
from .fit import fitting
from .hardware import Hardware
from .memory import Memory
from .modes import Mode, candidates
from .quality import Quality, SampleFactor, quality, samples_factor
from .shape import ModelShape
from .timeline import Batch, StepTime, step_time
from .wire import Layout, WireSettings

TIE = 0.03  # modes within 3% of the fastest count as equally fast


@dataclass(frozen=True)
class PlanRow:
    mode: Mode
    time: StepTime
    memory: Memory
    quality: Quality
    speedup_vs_ddp: float  # the reference DDP's step time / this step time
    factor: SampleFactor  # measured samples to AdamW's loss / AdamW's own
    to_loss_vs_ddp: float | None  # predicted time to AdamW's loss / the reference DDP's (None: unmeasured)
    activations: float = 0.0  # bytes of one micro-batch's activations per GPU
    checkpointing: bool = False  # with activation checkpointing (its recompute is in the step time)
    fits: bool = True  # state + activations within the GPU's memory (always, where none is stated)

    @property
    def adamw_class(self) -> bool:
        return self.mode.is_ddp or self.mode.spec.adamw_class

    @property
    def total_bytes(self) -> float:
        return self.memory.total + self.activations


@dataclass(frozen=True)
class Plan:
    rows: list[PlanRow]
    reference: Mode
    choice: PlanRow | None  # None: no mode fits (``why`` says what would)
    why: str
    soonest: PlanRow | None = None  # the first to AdamW's loss in wall-clock time (any strategy)
    why_soonest: str = ""
    memory_limit: float = 0.0  # bytes per GPU the rows were checked against (0: none)


def reference_mode(ws: WireSettings) -> Mode:
    """torch DDP at the compute dtype: the NCCL ring in bf16 on bf16 runs, fp32 otherwise."""
    return Mode("torch-ddp", ddp_dtype="bfloat16" if ws.compute_bytes == 2 else "float32")


def make_plan(shape: ModelShape, layout: Layout, hw: Hardware, batch: Batch, ws: WireSettings | None = None,
              modes: list[Mode] | None = None, allowed: tuple[str, ...] | None = None,
              memory_limit: float | None = None, allow_unmeasured: bool = False, steps: int | None = None,
              results: Path | None = None, checkpointing: str = "auto") -> Plan:
    """``steps``: the planned run's optimizer steps (the samples to AdamW's loss then come from the
    benchmark runs nearest that length, quality.samples_factor); ``results``: the folder of the
    benchmark JSONs (docs/results; None: no measured loss); ``memory_limit``: bytes per GPU
    (default: the hardware's; 0 or None on hardware without one: not checked)."""
    ws = ws or WireSettings()
    modes = modes or candidates(two_level=layout.ranks_per_node > 1)
    limit = memory_limit if memory_limit is not None else hw.memory_bytes
    ref = reference_mode(ws)
    if ref not in modes:
        modes = [ref] + list(modes)
    fit = {m: fitting(m, shape, layout, batch, ws, limit, checkpointing) for m in modes}
    times = {m: step_time(m, shape, layout, hw, replace(batch, checkpointing=fit[m][2]), ws) for m in modes}
    ref_s = times[ref].step_s
    rows = []
    for m in modes:
        state, act, ckpt, fits = fit[m]
        factor = SampleFactor(1.0, 0, ("the reference",)) if m == ref else samples_factor(m, results, steps=steps)
        warm = None
        if factor.warmup_fraction:  # a warmup that runs another strategy's rounds (1-bit Adam's AdamW)
            warm = step_time(replace(m, strategy=m.spec.warmup_as), shape, layout, hw,
                             replace(batch, checkpointing=ckpt), ws).step_s
        rows.append(PlanRow(m, times[m], state, quality(m, results), ref_s / times[m].step_s, factor,
                            time_to_loss(times[m].step_s, factor, warm) / ref_s if factor.factor is not None else None,
                            act, ckpt, fits))
    choice, why = recommend(rows, ref, allowed, allow_unmeasured)
    if choice is None:
        why += " " + what_would_fit(shape, layout, batch, ws, limit, modes, checkpointing)
    soonest, why_soonest = recommend_soonest(rows, ref)
    return Plan(rows, ref, choice, why, soonest, why_soonest, limit or 0.0)


def time_to_loss(step_s: float, factor: SampleFactor, warmup_step_s: float | None = None) -> float:
    """Seconds per AdamW-step-equivalent of progress to AdamW's loss: the mode needs ``factor``
    times AdamW's samples, its first ``warmup_fraction`` of AdamW's steps (1-bit Adam's warmup)
    at ``warmup_step_s``."""
    w = factor.warmup_fraction or 0.0
    if w and warmup_step_s is not None:
        return w * warmup_step_s + max(0.0, factor.factor - w) * step_s
    return factor.factor * step_s


def recommend_soonest(rows: list[PlanRow], ref: Mode) -> tuple[PlanRow | None, str]:
    """The mode predicted to reach AdamW's loss first (any strategy with a measured samples
    factor that fits; within 3% of the soonest, the simplest, AdamW's class first)."""
    pool = [r for r in rows if r.to_loss_vs_ddp is not None and r.fits]
    if not pool:
        return None, ""
    best = min(r.to_loss_vs_ddp for r in pool)
    near = [r for r in pool if r.to_loss_vs_ddp <= best * (1 + TIE)]
    pick = min(near, key=lambda r: (not r.adamw_class, simplicity(r.mode), r.to_loss_vs_ddp))
    f = pick.factor
    why = (f"{pick.mode.name}: predicted {pick.to_loss_vs_ddp:.2f}x {ref.name}'s time to AdamW's loss "
           f"({pick.time.step_s:.3g} s/step x {f.factor:.2f} AdamW's samples"
           + (f", its first {f.warmup_fraction:.0%} at the warmup's uncompressed round" if f.warmup_fraction else "")
           + (f"; median of {f.runs} measured runs)" if f.runs else "; the reference)"))
    if not pick.adamw_class:
        q = pick.quality.loss_vs_adamw_pct
        why += (". Its update is not AdamW's" + (f" (held-out loss {q:+.1f}% vs AdamW's at equal samples)"
                                                 if q is not None else "")
                + ": both figures come from a 4.87M GPT-2 over a few hundred steps, so check them on your "
                "model before a long run")
    return pick, why + "."


def simplicity(m: Mode) -> tuple:
    lossy = (m.codec != "none") + (m.param_codec in ("int8", "int4"))
    return (lossy, m.rounds, m.overlap, m.exchange != "flat", m.sharding != "none")


def recommend(rows: list[PlanRow], ref: Mode, allowed: tuple[str, ...] | None = None,
              allow_unmeasured: bool = False) -> tuple[PlanRow | None, str]:
    """The fastest fitting mode of ``allowed`` strategies (default: AdamW's class) whose measured
    (or inferred) loss per sample is within 0.5% of AdamW's; modes with no measurement (the
    delayed update, DDP's bf16 ring) only with ``allow_unmeasured`` (the reference DDP always
    counts). (None, why) when none fits."""
    pool = [r for r in rows if r.adamw_class and (allowed is None or r.mode.strategy in allowed)]

    def keeps_adamw(r: PlanRow) -> bool:
        q = r.quality.loss_vs_adamw_pct
        return r.mode == ref or (q is None and allow_unmeasured) or (q is not None and q <= 0.5)

    pool = [r for r in pool if keeps_adamw(r)]
    if not pool:
        raise ValueError(f"no candidate among the allowed strategies {allowed}")
    fits = [r for r in pool if r.fits]
    if not fits:
        least = min(pool, key=lambda r: r.total_bytes)
        return None, (f"No mode that keeps AdamW's loss fits: the smallest, {least.mode.name}, needs "
                      f"{least.total_bytes / 2**30:.3g} GiB per GPU ({least.memory.total / 2**30:.3g} GiB of state, "
                      f"{least.activations / 2**30:.3g} GiB of activations"
                      + (", checkpointed" if least.checkpointing else "") + ").")
    pool = fits
    best = min(r.time.step_s for r in pool)
    near = [r for r in pool if r.time.step_s <= best * (1 + TIE)]
    choice = min(near, key=lambda r: (simplicity(r.mode), r.time.step_s))
    t = choice.time
    bound = "the link" if t.exposed_s > 0.05 * t.step_s else "compute"
    why = (f"{choice.mode.name}: predicted {t.step_s:.3g} s/step, {choice.speedup_vs_ddp:.2f}x {ref.name}; "
           f"compute {t.compute_s:.3g} s, node link {t.inter_s:.3g} s, inside the node {t.intra_s:.3g} s, "
           f"comm-side work {t.comm_work_s:.3g} s, exposed {t.exposed_s:.3g} s (bound by {bound}); "
           f"{choice.time.bytes.node_link / 1e9:.3g} GB per node link per step, "
           f"{choice.memory.total / 2**30:.3g} GiB of state and {choice.activations / 2**30:.3g} GiB of activations "
           f"per GPU" + (" (activation checkpointing: needed to fit)" if choice.checkpointing else "") + ". ")
    if len(near) > 1:
        why += (f"{len(near) - 1} other mode(s) within {TIE:.0%} of the fastest: the one with the fewest lossy "
                "codecs and rounds was taken. ")
    q = choice.quality
    why += ("Loss per sample: the reference." if choice.mode == ref else
            f"Loss per sample vs AdamW: {q.loss_vs_adamw_pct:+.2f}% (median of {len(q.sources)} measured rows"
            + (f"; {q.note}" if q.note else "") + ")."
            if q.loss_vs_adamw_pct is not None and q.sources else
            f"Loss per sample: {q.note or 'not measured'}.")
    return choice, why


def format_plan(plan: Plan) -> str:
    limit = f" of {plan.memory_limit / 2**30:.3g}" if plan.memory_limit else ""
    head = ["mode", "s/step", "vs " + plan.reference.name, "compute s", "node link s", "intra s", "comm work s",
            "exposed s", "GB/node link/step", "state GiB/GPU", "activations GiB", f"fits{limit} GiB",
            "loss vs AdamW", "samples to AdamW's loss", "time to it vs " + plan.reference.name]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(plan.rows, key=lambda r: r.time.step_s):
        t, q = r.time, r.quality
        loss = "-" if q.loss_vs_adamw_pct is None else f"{q.loss_vs_adamw_pct:+.2f}%"
        factor = "-" if r.factor.factor is None else f"{r.factor.factor:.2f}x"
        to_loss = "-" if r.to_loss_vs_ddp is None else f"{r.to_loss_vs_ddp:.2f}x"
        fits = ("yes" if r.fits else "no") + (" (checkpointed)" if r.checkpointing else "")
        mark = "**" if r is plan.choice else ""
        lines.append(f"| {mark}{r.mode.name}{mark} | {t.step_s:.3g} | {r.speedup_vs_ddp:.2f}x | {t.compute_s:.3g} | "
                     f"{t.inter_s:.3g} | {t.intra_s:.3g} | {t.comm_work_s:.3g} | {t.exposed_s:.3g} | "
                     f"{t.bytes.node_link / 1e9:.4g} | {r.memory.total / 2**30:.3g} | {r.activations / 2**30:.3g} | "
                     f"{fits} | {loss} | {factor} | {to_loss} |")
    lines.append("")
    lines.append(("Recommended (keeps AdamW's loss per sample): " if plan.choice else "Nothing to recommend: ")
                 + plan.why)
    if plan.soonest is not None:
        lines.append("")
        lines.append("Soonest to AdamW's loss: " + plan.why_soonest)
    return "\n".join(lines)
