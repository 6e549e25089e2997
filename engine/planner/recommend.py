"""The planner's rows and its recommendation.

``make_plan`` predicts every candidate mode (engine/planner/modes.py) on one cluster and batch:
step time, memory and whether it fits, and from the measured evidence (evidence.py) its loss per
sample and samples to AdamW's loss at the run's global batch and length. The recommendation is
``decide`` (decide.py), the rule ``strategy="auto"`` uses too, for the caller's goal; when nothing
fits it says what would (advice.py). Beside it, the soonest to AdamW's loss over every measured
mode, whatever its update (a local-step method or 1-bit Adam where the link is slow), by the same
rule with the goal ``time_to_loss``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .advice import what_would_fit
from .decide import TIE, decide, runnable, simplicity, time_to_loss  # noqa: F401 (re-exported)
from .evidence import Estimate, estimate, warmup_fraction
from .fit import Limits, fitting
from .goal import OPTIMIZER_NAMES, Goal
from .hardware import Hardware
from .memory import Memory
from .modes import Mode, candidates, runs_with
from .shape import ModelShape
from .timeline import Batch, StepTime, step_time
from .wire import Layout, WireSettings


@dataclass(frozen=True)
class PlanRow:
    mode: Mode
    time: StepTime
    memory: Memory
    loss: Estimate  # held-out loss at equal samples vs AdamW's, percent, at the run's B and length
    speedup_vs_ddp: float | None  # the reference DDP's step time / this step time (None: not priced)
    factor: Estimate  # measured samples to AdamW's loss / AdamW's own, at the run's B and length
    to_loss_vs_ddp: float | None  # predicted time to AdamW's loss / the reference DDP's (None: unmeasured)
    activations: float = 0.0  # bytes of one micro-batch's activations per GPU
    checkpointing: bool = False  # with activation checkpointing (its recompute is in the step time)
    fits: bool = True  # state + activations within the GPU's memory (always, where none is stated)
    samples_per_step: int = 1  # the global batch this row was priced at
    warmup_step_s: float | None = None  # 1-bit Adam: the step time of its uncompressed warmup
    warmup_fraction: float | None = None  # 1-bit Adam: its warmup's share of AdamW's steps to the loss

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
    choice: PlanRow | None  # None: no mode qualifies or fits (``why`` says what would)
    why: str
    soonest: PlanRow | None = None  # the first to AdamW's loss in wall-clock time (any measured mode)
    why_soonest: str = ""
    memory_limit: float = 0.0  # bytes per GPU the rows were checked against (0: none)
    goal: Goal = field(default_factory=Goal)
    host_limit: float = 0.0  # host bytes per GPU (a node's over its GPUs) the rows were checked against (0: none)


def reference_mode(ws: WireSettings) -> Mode:
    """torch DDP at the compute dtype: the NCCL ring in bf16 on bf16 runs, fp32 otherwise."""
    return Mode("torch-ddp", ddp_dtype="bfloat16" if ws.compute_bytes == 2 else "float32")


def plan_rows(shape: ModelShape, layout: Layout, hw: Hardware, batch: Batch, ws: WireSettings, modes: list[Mode],
              limit: float | Limits | None, steps: int | None, results: Path | None, checkpointing: str,
              label: str = "the run", with_reference: bool = True, optimizer: str = "adamw") -> tuple[list[PlanRow], Mode]:
    """Every mode's row at ``batch``; the loss figures at B = ``batch.global_samples`` and a run
    of ``steps`` x B samples (None: the longest measured at each B). ``with_reference``: price
    torch DDP too and give every row its ratios to it (strategy="auto" does not: a probe of one
    node has no rate for DDP's ring). ``optimizer``: the run's (EngineConfig's); a mode the engine
    does not step with it is left out, and the state is priced for it."""
    ws = replace(ws, optimizer=optimizer)
    modes = [m for m in modes if runs_with(m, optimizer)]
    ref = reference_mode(ws)
    if with_reference and ref not in modes:
        modes = [ref] + list(modes)
    fit = {m: fitting(m, shape, layout, batch, ws, limit, checkpointing) for m in modes}
    times = {m: step_time(m, shape, layout, hw, replace(batch, checkpointing=fit[m][2]), ws) for m in modes}
    ref_s = times[ref].step_s if with_reference else None
    b = batch.global_samples
    samples = steps * b if steps is not None else None
    rows = []
    for m in modes:
        state, act, ckpt, fits = fit[m]
        loss = estimate(m, results, b, samples, "gap_pct", label, optimizer=optimizer)
        factor = estimate(m, results, b, samples, "factor", label, optimizer=optimizer)
        warm = warm_s = None
        if not m.is_ddp and m.spec.warmup_as and factor.measured:  # 1-bit Adam's AdamW warmup
            warm = warmup_fraction(factor)
            warm_s = step_time(replace(m, strategy=m.spec.warmup_as), shape, layout, hw,
                               replace(batch, checkpointing=ckpt), ws).step_s if warm else None
        to_loss = (time_to_loss(times[m].step_s, factor.value, warm, warm_s) / ref_s
                   if factor.measured and ref_s else None)
        rows.append(PlanRow(m, times[m], state, loss, ref_s / times[m].step_s if ref_s else None, factor, to_loss,
                            act, ckpt, fits, b, warm_s, warm))
    return rows, ref


def make_plan(shape: ModelShape, layout: Layout, hw: Hardware, batch: Batch, ws: WireSettings | None = None,
              modes: list[Mode] | None = None, memory_limit: float | None = None, steps: int | None = None,
              results: Path | None = None, checkpointing: str = "auto", goal: Goal | None = None,
              topology: str = "auto", model_sharding: str | None = None, optimizer_offload: str | None = None,
              label: str | None = None) -> Plan:
    """``steps``: the planned run's optimizer steps (its length, steps x B samples, places it in the
    evidence); ``results``: the folder of the benchmark JSONs (docs/results; None: nothing
    measured, nothing recommended); ``memory_limit``: bytes per GPU (default: the hardware's; 0
    or None on hardware without one: not checked); ``goal``: what the recommendation optimizes
    (goal.py; default: keep AdamW's loss per sample within 0.5%); ``topology``,
    ``model_sharding`` and ``optimizer_offload``: the run's settings the recommendation must run
    (as EngineConfig's; None: either)."""
    goal = goal or Goal()
    ws = replace(ws or WireSettings(), optimizer=goal.optimizer)  # the run's optimizer is the goal's
    modes = [m for m in modes or candidates(two_level=layout.ranks_per_node > 1) if runs_with(m, goal.optimizer)]
    limit = Limits(memory_limit if memory_limit is not None else hw.memory_bytes, hw.host_memory_bytes)
    label = label or f"the {shape.params / 1e9:.3g}B run"
    rows, ref = plan_rows(shape, layout, hw, batch, ws, modes, limit, steps, results, checkpointing, label,
                          optimizer=goal.optimizer)
    settings = (topology, model_sharding, optimizer_offload)
    decision = decide(rows, goal, lambda m: _pool(m, layout, *settings))
    why = decision.why
    if decision.choice is None and any(_pool(r.mode, layout, *settings) and not r.fits for r in rows):
        why += " " + what_would_fit(shape, layout, batch, ws, limit, modes, checkpointing,
                                    lambda m: meets_goal(m, goal, results, rows[0].samples_per_step, steps))
    soon = decide(rows, Goal("time_to_loss", optimizer=goal.optimizer),
                  lambda m: not (m.is_ddp and m.ddp_dtype != "float32"), list_faster=0)
    return Plan(rows, ref, decision.choice, why, soon.choice, _soonest_why(soon), limit.device or 0.0, goal,
                limit.host)


def meets_goal(m: Mode, goal: Goal, results: Path | None, global_batch: int, steps: int | None) -> bool:
    """Whether the rule could take ``m`` once it fits: in its pool, measured, within the goal's bound."""
    from .decide import in_pool

    if not in_pool(m) or not runs_with(m, goal.optimizer):
        return False
    samples = steps * global_batch if steps is not None else None
    est = estimate(m, results, global_batch, samples, "factor" if goal.kind == "time_to_loss" else "gap_pct",
                   optimizer=goal.optimizer)
    return est.measured and (goal.kind == "time_to_loss" or est.value <= goal.loss_bound_pct)


def _pool(m: Mode, layout: Layout, topology: str, model_sharding: str | None, optimizer_offload: str | None) -> bool:
    from .decide import in_pool

    return in_pool(m) and runnable(m, layout, topology, model_sharding, optimizer_offload)


def _soonest_why(soon) -> str:
    pick = soon.choice
    if pick is None:
        return ""
    text = soon.why.split(". ", 1)[1] if ". " in soon.why else soon.why
    if not pick.adamw_class:
        q, opt = pick.loss.value, OPTIMIZER_NAMES[soon.goal.optimizer]
        text += (f" Its update is not {opt}'s" + (f" (held-out loss {q:+.1f}% vs {opt}'s at equal samples)"
                                                   if q is not None else "")
                 + ": both figures come from a 4.87M GPT-2 over a few hundred steps, so check them on your "
                 "model before a long run.")
    return text


def _too_few(est: Estimate) -> str:
    """The row with the most seeds among those that do not qualify, e.g. " (+16.90% at B 16, 1 seed)"."""
    if not est.unqualified:
        return ""
    p = max(est.unqualified, key=lambda p: len(p.seeds))
    return f" ({p.gap_pct:+.2f}% at B {p.global_batch}, {len(p.seeds)} seed{'s' if len(p.seeds) > 1 else ''})"


def format_plan(plan: Plan) -> str:
    opt = OPTIMIZER_NAMES[plan.goal.optimizer]
    limit = f" of {plan.memory_limit / 2**30:.3g}" if plan.memory_limit else ""
    head = ["mode", "s/step", "vs " + plan.reference.name, "compute s", "node link s", "intra s", "comm work s",
            "exposed s", "GB/node link/step", "state GiB/GPU", "activations GiB", f"fits{limit} GiB",
            f"loss vs {opt} [evidence]", f"samples to {opt}'s loss", "time to it vs " + plan.reference.name]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(plan.rows, key=lambda r: r.time.step_s):
        t, q = r.time, r.loss
        loss = ("0 (reference)" if q.reference else f"{q.value:+.2f}% [{q.evidence()}]" if q.measured
                else "not measured" + _too_few(q))
        factor = "-" if not r.factor.measured else f"{r.factor.value:.2f}x"
        to_loss = "-" if r.to_loss_vs_ddp is None else f"{r.to_loss_vs_ddp:.2f}x"
        out_on_host = plan.host_limit and r.memory.host > plan.host_limit
        fits = (f"no: host {r.memory.host / 2**30:.3g} of {plan.host_limit / 2**30:.3g} GiB" if out_on_host else
                ("yes" if r.fits else "no") + (" (checkpointed)" if r.checkpointing else ""))
        mark = "**" if r is plan.choice else ""
        lines.append(f"| {mark}{r.mode.name}{mark} | {t.step_s:.3g} | {r.speedup_vs_ddp:.2f}x | {t.compute_s:.3g} | "
                     f"{t.inter_s:.3g} | {t.intra_s:.3g} | {t.comm_work_s:.3g} | {t.exposed_s:.3g} | "
                     f"{t.bytes.node_link / 1e9:.4g} | {r.memory.total / 2**30:.3g} | {r.activations / 2**30:.3g} | "
                     f"{fits} | {loss} | {factor} | {to_loss} |")
    lines.append("")
    lines.append(("Recommended: " if plan.choice else "Nothing to recommend: ") + plan.why)
    if plan.soonest is not None:
        lines.append("")
        lines.append(f"Soonest to {opt}'s loss (any measured mode, whatever its update): " + plan.why_soonest)
    return "\n".join(lines)
