"""The planner's rows and its recommendation.

``make_plan`` predicts every candidate mode (engine/planner/modes.py) on one cluster and batch;
``recommend`` picks the fastest of the modes that keep synchronous AdamW's loss per sample
(torch DDP, zero1, dpu, acco, with or without LoCo-4 gradients and int8/int4 parameter deltas;
measured in docs/results where the benchmark ran them) and says why; among modes within 3% of
the fastest it takes the simplest (fewest lossy codecs, then one round per step).
``recommend_soonest`` answers the other question a user asks: which mode reaches AdamW's loss
first in wall-clock time, whatever its loss per sample, from each mode's measured samples to
that loss (quality.samples_factor) times its predicted step time."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import Hardware
from .memory import Memory, memory_per_gpu
from .modes import AUTO_STRATEGIES, Mode, candidates
from .quality import Quality, SampleFactor, quality, samples_factor
from .shape import ModelShape
from .timeline import Batch, StepTime, step_time
from .wire import Layout, WireSettings

ADAMW_CLASS = ("torch-ddp",) + AUTO_STRATEGIES
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

    @property
    def adamw_class(self) -> bool:
        return self.mode.strategy in ADAMW_CLASS


@dataclass(frozen=True)
class Plan:
    rows: list[PlanRow]
    reference: Mode
    choice: PlanRow
    why: str
    soonest: PlanRow | None = None  # the first to AdamW's loss in wall-clock time (any strategy)
    why_soonest: str = ""


def reference_mode(ws: WireSettings) -> Mode:
    """torch DDP at the compute dtype: the NCCL ring in bf16 on bf16 runs, fp32 otherwise."""
    return Mode("torch-ddp", ddp_dtype="bfloat16" if ws.compute_bytes == 2 else "float32")


def make_plan(shape: ModelShape, layout: Layout, hw: Hardware, batch: Batch, ws: WireSettings | None = None,
              modes: list[Mode] | None = None, allowed: tuple[str, ...] | None = None,
              memory_limit: float | None = None, allow_unmeasured: bool = False, steps: int | None = None) -> Plan:
    """``steps``: the planned run's optimizer steps (the samples to AdamW's loss then come from the
    benchmark runs nearest that length, quality.samples_factor)."""
    ws = ws or WireSettings()
    modes = modes or candidates(two_level=layout.per_node > 1)
    ref = reference_mode(ws)
    if ref not in modes:
        modes = [ref] + list(modes)
    times = {m: step_time(m, shape, layout, hw, batch, ws) for m in modes}
    ref_s = times[ref].step_s
    rows = []
    for m in modes:
        factor = SampleFactor(1.0, 0, ("the reference",)) if m == ref else samples_factor(m, steps=steps)
        warm = None
        if factor.warmup_fraction:  # 1-bit Adam's AdamW warmup runs zero1's uncompressed round
            warm = step_time(replace(m, strategy="zero1"), shape, layout, hw, batch, ws).step_s
        rows.append(PlanRow(m, times[m], memory_per_gpu(m, shape, layout, ws), quality(m), ref_s / times[m].step_s,
                            factor, time_to_loss(times[m].step_s, factor, warm) / ref_s
                            if factor.factor is not None else None))
    choice, why = recommend(rows, ref, allowed, memory_limit, allow_unmeasured)
    soonest, why_soonest = recommend_soonest(rows, ref, memory_limit)
    return Plan(rows, ref, choice, why, soonest, why_soonest)


def time_to_loss(step_s: float, factor: SampleFactor, warmup_step_s: float | None = None) -> float:
    """Seconds per AdamW-step-equivalent of progress to AdamW's loss: the mode needs ``factor``
    times AdamW's samples, its first ``warmup_fraction`` of AdamW's steps (1-bit Adam's warmup)
    at ``warmup_step_s``."""
    w = factor.warmup_fraction or 0.0
    if w and warmup_step_s is not None:
        return w * warmup_step_s + max(0.0, factor.factor - w) * step_s
    return factor.factor * step_s


def recommend_soonest(rows: list[PlanRow], ref: Mode, memory_limit: float | None = None
                      ) -> tuple[PlanRow | None, str]:
    """The mode predicted to reach AdamW's loss first (any strategy with a measured samples
    factor; within 3% of the soonest, the simplest, AdamW's class first)."""
    pool = [r for r in rows if r.to_loss_vs_ddp is not None
            and (not memory_limit or r.memory.total <= memory_limit)]
    if not pool:
        return None, ""
    best = min(r.to_loss_vs_ddp for r in pool)
    near = [r for r in pool if r.to_loss_vs_ddp <= best * (1 + TIE)]
    pick = min(near, key=lambda r: (not r.adamw_class, _simplicity(r.mode), r.to_loss_vs_ddp))
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


def _simplicity(m: Mode) -> tuple:
    lossy = (m.codec != "none") + (m.param_codec in ("int8", "int4"))
    return (lossy, m.rounds, m.strategy != "zero1", m.exchange != "flat")


def recommend(rows: list[PlanRow], ref: Mode, allowed: tuple[str, ...] | None = None,
              memory_limit: float | None = None, allow_unmeasured: bool = False) -> tuple[PlanRow, str]:
    """The fastest mode of ``allowed`` strategies whose measured (or inferred) loss per sample is
    within 0.5% of AdamW's; modes with no measurement (dpu, DDP's bf16 ring) only with
    ``allow_unmeasured`` (the reference DDP always counts)."""
    allowed = allowed or ADAMW_CLASS
    pool = [r for r in rows if r.mode.strategy in allowed and r.adamw_class]

    def keeps_adamw(r: PlanRow) -> bool:
        q = r.quality.loss_vs_adamw_pct
        return r.mode == ref or (q is None and allow_unmeasured) or (q is not None and q <= 0.5)

    pool = [r for r in pool if keeps_adamw(r)]
    if memory_limit:
        fits = [r for r in pool if r.memory.total <= memory_limit]
        if not fits:
            raise ValueError(f"no candidate fits {memory_limit / 2**30:.1f} GiB of training state per GPU; "
                             "add GPUs (zero1's shards shrink with N) or train fewer parameters")
        pool = fits
    if not pool:
        raise ValueError(f"no candidate among the allowed strategies {allowed}")
    best = min(r.time.step_s for r in pool)
    near = [r for r in pool if r.time.step_s <= best * (1 + TIE)]
    choice = min(near, key=lambda r: (_simplicity(r.mode), r.time.step_s))
    t = choice.time
    bound = "the link" if t.exposed_s > 0.05 * t.step_s else "compute"
    why = (f"{choice.mode.name}: predicted {t.step_s:.3g} s/step, {choice.speedup_vs_ddp:.2f}x {ref.name}; "
           f"compute {t.compute_s:.3g} s, node link {t.inter_s:.3g} s, inside the node {t.intra_s:.3g} s, "
           f"comm-side work {t.comm_work_s:.3g} s, exposed {t.exposed_s:.3g} s (bound by {bound}); "
           f"{choice.time.bytes.node_link / 1e9:.3g} GB per node link per step, "
           f"{choice.memory.total / 2**30:.3g} GiB of state per GPU. ")
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


def format_plan(plan: Plan, gib: bool = True) -> str:
    head = ["mode", "s/step", "vs " + plan.reference.name, "compute s", "node link s", "intra s", "comm work s",
            "exposed s", "GB/node link/step", "state GiB/GPU", "loss vs AdamW", "samples to AdamW's loss",
            "time to it vs " + plan.reference.name]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(plan.rows, key=lambda r: r.time.step_s):
        t, q = r.time, r.quality
        loss = "-" if q.loss_vs_adamw_pct is None else f"{q.loss_vs_adamw_pct:+.2f}%"
        factor = "-" if r.factor.factor is None else f"{r.factor.factor:.2f}x"
        to_loss = "-" if r.to_loss_vs_ddp is None else f"{r.to_loss_vs_ddp:.2f}x"
        mark = "**" if r is plan.choice else ""
        lines.append(f"| {mark}{r.mode.name}{mark} | {t.step_s:.3g} | {r.speedup_vs_ddp:.2f}x | {t.compute_s:.3g} | "
                     f"{t.inter_s:.3g} | {t.intra_s:.3g} | {t.comm_work_s:.3g} | {t.exposed_s:.3g} | "
                     f"{t.bytes.node_link / 1e9:.4g} | {r.memory.total / 2**30:.3g} | {loss} | {factor} | {to_loss} |")
    lines.append("")
    lines.append("Recommended (keeps AdamW's loss per sample): " + plan.why)
    if plan.soonest is not None:
        lines.append("")
        lines.append("Soonest to AdamW's loss: " + plan.why_soonest)
    return "\n".join(lines)
