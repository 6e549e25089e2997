"""The one table of training modes (a name -> how to train it) and the benchmark's two protocols.

Used by the benchmark (``recipes/benchmark.py``, ``benchmarks/runner.py``, ``worker.py``,
``report.py``), by ``benchmarks/loco_quality.py`` and by ``tests/engine/test_loco_engine.py``;
each picks the modes it runs from here by name. A mode is either

* an engine mode: flat :class:`engine.EngineConfig` keyword arguments (``strategy``, ``codec``,
  ``param_codec`` and any further fields in ``extra``), see :meth:`Mode.engine_kwargs`; or
  A local-step mode (strategy diloco or sparseloco, :func:`is_local_steps`) counts one inner step
  of every worker as its optimizer step: at matched batch each inner step reads B samples (one
  micro-batch of DDP's size per worker at B = 16, as DDP at accumulation 1), and an outer round
  follows every ``inner_steps`` of them. Its samples are cheap, so ``recipes/benchmark.py
  --local-samples-factor K`` gives these modes K times the budget (the table says the samples
  each mode used; losses are compared at equal samples);
* a torch DDP variant: torch's own DistributedDataParallel + torch.optim.AdamW, with ``no_sync``
  accumulation of ``accumulation`` micro-batches (None: the protocol's, see below) and,
  optionally, the PowerSGD comm hook of matrix rank ``powersgd_rank`` (error feedback on).

The uncompressed engine modes send fp32 parameters (``param_codec="float32"``): every user of
this table trains in float32, where that is also what ``"auto"`` picks.

The benchmark's protocols (``recipes/benchmark.py --protocol``):

* ``matched`` (the headline): every mode trains at the same global batch of B samples per
  optimizer step (:func:`matched_batch`): torch DDP at ``--micro-batch`` m with accumulation
  B / (m x workers); an engine mode with ``accumulation="fixed"`` and ``global_micro_batches =
  B / m_e``, where its micro-batch m_e is the largest divisor of m that gives every worker the
  same whole number (at least one) of micro-batches in every round of a step (ACCO splits a
  step over 2 rounds: B = 16 on 2 workers at m = 8 gives m_e = 4, 2 rounds x 2 workers x 4).
  Each worker then reads exactly the windows DDP's worker reads for each step, in the same
  order. Every mode follows one lr schedule (:func:`matched_schedule`: linear warmup over the
  first 5% of the steps, then cosine to 10% of the peak), computed by the engine's own
  :func:`acco_loco.schedule.lr_at`. The target is ``torch-ddp``'s final held-out loss.
* ``free``: each engine mode at the batch it likes (``accumulation="grow"``: a round keeps
  accumulating while the previous one is on the wire, capped per round), DDP at its fixed
  accumulation, constant lr; the target is ``torch-ddp-acc1``'s final held-out loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from acco_loco.schedule import lr_at

PROTOCOLS = ("matched", "free")


@dataclass(frozen=True)
class DdpVariant:
    # micro-batches per worker and step, all but the last under no_sync; None: the protocol's
    # (B / (micro-batch x workers) under matched batch, 1 under free batch)
    accumulation: int | None = None
    powersgd_rank: int | None = None  # PowerSGD's matrix rank; None: DDP's plain all-reduce


@dataclass(frozen=True)
class Mode:
    strategy: str | None = None  # EngineConfig.strategy; None for a DDP variant
    codec: str = "none"  # gradient codec
    param_codec: str = "float32"  # parameter all-gather codec
    extra: Mapping[str, Any] = field(default_factory=dict)  # further EngineConfig fields
    ddp: DdpVariant | None = None

    @property
    def kind(self) -> str:
        """``"torch-ddp"`` or ``"engine"`` (the benchmark JSON's ``kind`` field)."""
        return "torch-ddp" if self.ddp is not None else "engine"

    @property
    def local_steps(self) -> bool:
        """Whether this is a local-step mode (diloco, sparseloco): one history entry per inner step."""
        return self.strategy is not None and is_local_steps(self.strategy)

    @property
    def protocols(self) -> tuple[str, ...]:
        """The protocols this mode can run under: a DDP variant with its own accumulation and an
        engine mode that grows its batch choose their batch themselves (free batch only); a
        local-step mode's inner step takes a fixed batch (matched only)."""
        fixed_ddp = self.ddp is not None and self.ddp.accumulation is not None
        grows = self.extra.get("accumulation") == "grow"
        if self.local_steps:
            return ("matched",)
        return ("free",) if fixed_ddp or grows else PROTOCOLS

    def engine_kwargs(self) -> dict[str, Any]:
        """The flat EngineConfig keyword arguments of an engine mode."""
        if self.ddp is not None:
            raise ValueError("a torch DDP variant has no engine configuration")
        return {"strategy": self.strategy, "codec": self.codec, "param_codec": self.param_codec,
                **self.extra}


def _engine(strategy: str, codec: str = "none", param_codec: str = "float32", **extra: Any) -> Mode:
    return Mode(strategy, codec, param_codec, extra)


def _ddp(accumulation: int | None = None, powersgd_rank: int | None = None) -> Mode:
    return Mode(ddp=DdpVariant(accumulation, powersgd_rank))


_ACCO_LOCO4_INT8 = _engine("acco", "loco4", "int8")
DC_LAMBDA = 5e4  # acco+dc's lambda: the median least-squares fit on the benchmark model (docs/acco_delay.md)
SYNC_STEPS = 10  # acco+sync's synchronous first steps: the protocol's lr warmup

MODES: dict[str, Mode] = {
    # torch's DistributedDataParallel (the benchmark's baselines); torch-ddp and PowerSGD take
    # the protocol's accumulation (from --global-batch under matched batch, 1 under free batch)
    "torch-ddp": _ddp(),
    "torch-ddp-acc1": _ddp(1),
    "torch-ddp-acc4": _ddp(4),
    "torch-ddp-acc12": _ddp(12),
    "torch-ddp+powersgd1": _ddp(powersgd_rank=1),
    "torch-ddp+powersgd4": _ddp(powersgd_rank=4),
    # this engine, uncompressed
    "zero1": _engine("zero1"),
    "dpu": _engine("dpu"),
    "acco": _engine("acco"),
    # ACCO with a delay correction of the stale half (the acco section, acco_loco/delay.py,
    # docs/acco_delay.md): DC-ASGD's g*g compensation at lambda DC_LAMBDA; weight prediction,
    # the estimate at theta_t + 1 x the last committed update
    "acco+dc": _engine("acco", delay_compensation=DC_LAMBDA),
    "acco+wp": _engine("acco", weight_prediction=1.0),
    # ACCO whose first SYNC_STEPS steps run synchronously (the acco section's sync_steps)
    "acco+sync": _engine("acco", sync_steps=SYNC_STEPS),
    # ACCO whose estimate round is clipped by the last commit's norm, not its half's (estimate_clip)
    "acco+stepclip": _engine("acco", estimate_clip="step"),
    # zero1 with a round's micro-batches shared out equally whatever --balance says: under
    # --hetero --balance speed, the synchronous baseline a user has without speed shares
    "zero1+equal-shares": _engine("zero1", balance="equal"),
    # this engine, compressed: LoCo 4-bit gradients + int8 / int4 parameter deltas
    "acco+loco4": _ACCO_LOCO4_INT8,
    "acco+loco4+int8": _ACCO_LOCO4_INT8,  # the same mode under loco_quality's name
    "acco+loco4+int4params": _engine("acco", "loco4", "int4"),
    # ... the same codecs on the synchronous ZeRO-1 round (named as the acco ones: int8 deltas
    # unless int4params says otherwise)
    "zero1+loco4": _engine("zero1", "loco4", "int8"),
    "zero1+loco4+int4params": _engine("zero1", "loco4", "int4"),
    # free batch only: the shortest growing rounds, one micro-batch per round and worker whatever
    # the round costs (the smallest ACCO batch, 2 x workers micro-batches per step; the comm
    # side's CPU is not amortized)
    "acco+loco4+int4params+cap1": _engine("acco", "loco4", "int4", accumulation="grow", max_micro_batches=1,
                                          max_round_overhead=0.0),
    # plain 4-bit gradients (no error compensation), other gradient codecs
    "acco+int4": _engine("acco", "int4"),
    "acco+int4+int8": _engine("acco", "int4", "int8"),
    "dpu+ef8+bf16": _engine("dpu", "ef8", "bfloat16"),
    # 1-bit Adam (docs/onebit_adam.md): AdamW until the variance rule freezes the second
    # moment, then 1-bit momentum both ways; one round per step, synchronous
    "onebit-adam": _engine("onebit_adam"),
    # local steps (docs/local_steps.md): an outer round every H inner steps; the outer lr
    # and momentum, density and error decay are the engine's defaults (DiLoCo's 0.7 / 0.9,
    # SparseLoCo's 2% top-k of 4096-value chunks, 2-bit values, beta 0.95)
    "diloco-h15": _engine("diloco", inner_steps=15),
    "diloco-h50": _engine("diloco", inner_steps=50),
    "sparseloco-h15": _engine("sparseloco", inner_steps=15),
    "sparseloco-h50": _engine("sparseloco", inner_steps=50),
    # ... overlapped: inner steps go on while the outer round travels, merged one round late
    "diloco-h15+overlap": _engine("diloco", inner_steps=15, outer_overlap=True),
    "sparseloco-h15+overlap": _engine("sparseloco", inner_steps=15, outer_overlap=True),
    "sparseloco-h50+overlap": _engine("sparseloco", inner_steps=50, outer_overlap=True),
    # ... with templar's choices, one at a time (docs/sparseloco.md): tiles per tensor, median-norm clip,
    # outer_lr in the error feedback
    "sparseloco-h15+tiles": _engine("sparseloco", inner_steps=15, topk_layout="tensor"),
    "sparseloco-h15+clip": _engine("sparseloco", inner_steps=15, sparse_clip="median"),
    "sparseloco-h15+efscale": _engine("sparseloco", inner_steps=15, sparse_error_scale="outer_lr"),
}

# Topology variants of every engine mode: ``<mode>@flat`` (every exchange over all M x G ranks)
# and ``<mode>@two_level`` (inside the node first, then only the node's part over the node's
# link: EngineConfig.topology). A name without ``@`` leaves topology to the engine's default
# ("auto": two-level when there are several nodes of several ranks).
TOPOLOGIES = ("flat", "two_level")
for _name, _mode in list(MODES.items()):
    if _mode.ddp is None:
        for _t in TOPOLOGIES:
            MODES[f"{_name}@{_t}"] = Mode(_mode.strategy, _mode.codec, _mode.param_codec,
                                          {**_mode.extra, "topology": _t})


def topology_of(name: str) -> str | None:
    """The topology a mode name asks for ("flat", "two_level"), None: the engine's default (or DDP)."""
    return MODES[name].extra.get("topology") if name in MODES else None


# recipes/benchmark.py: every mode it can run, in its table's order ...
BENCHMARK_MODES = ("torch-ddp", "torch-ddp-acc1", "torch-ddp-acc4", "torch-ddp-acc12", "torch-ddp+powersgd1",
                   "torch-ddp+powersgd4", "zero1", "zero1+equal-shares", "dpu", "acco", "acco+dc", "acco+wp", "acco+sync", "acco+stepclip",
                   "acco+loco4", "acco+loco4+int4params",
                   "zero1+loco4", "zero1+loco4+int4params", "acco+loco4+int4params+cap1", "onebit-adam", "diloco-h15", "diloco-h50", "sparseloco-h15", "sparseloco-h50",
                   "diloco-h15+overlap", "sparseloco-h15+overlap", "sparseloco-h50+overlap",
                   "sparseloco-h15+tiles", "sparseloco-h15+clip", "sparseloco-h15+efscale")
# ... each engine mode also as <mode>@flat and <mode>@two_level
BENCHMARK_MODES += tuple(f"{n}@{t}" for n in BENCHMARK_MODES if MODES[n].ddp is None for t in TOPOLOGIES)
# ... its default --modes per protocol, without and with --hetero ...
DEFAULT_MODES = {
    ("matched", False): ("torch-ddp", "torch-ddp+powersgd4", "zero1", "acco", "acco+loco4",
                         "acco+loco4+int4params"),
    ("matched", True): ("torch-ddp", "zero1", "acco", "acco+loco4+int4params"),
    ("free", False): ("torch-ddp-acc1", "torch-ddp-acc4", "torch-ddp-acc12", "torch-ddp+powersgd1",
                      "torch-ddp+powersgd4", "zero1", "dpu", "acco", "acco+loco4", "acco+loco4+int4params",
                      "acco+loco4+int4params+cap1"),
    ("free", True): ("torch-ddp-acc1", "torch-ddp-acc4", "torch-ddp-acc12", "torch-ddp+powersgd1",
                     "torch-ddp+powersgd4", "zero1", "acco", "acco+loco4", "acco+loco4+int4params"),
}
# ... and per protocol the mode whose final held-out loss is the target and whose figures the
# ratios divide by
REFERENCES = {"matched": "torch-ddp", "free": "torch-ddp-acc1"}

# benchmarks/loco_quality.py: the modes it can run
QUALITY_MODES = ("zero1", "acco", "acco+loco4+int8", "acco+int4+int8")


def engine_modes(names) -> dict[str, dict[str, Any]]:
    """name -> EngineConfig keyword arguments, for engine modes picked from the table by name."""
    return {n: MODES[n].engine_kwargs() for n in names}


# ------------------------------------------------------------------ the batch of each mode
class BatchError(ValueError):
    """A global batch that a mode cannot train at (the message says why and what works)."""


@dataclass(frozen=True)
class BatchPlan:
    """How one mode takes its samples per optimizer step."""

    micro_batch: int  # sequences per micro-batch this mode reads
    samples_per_step: int | None  # the global batch; None: it grows (free batch)
    accumulation: int | None = None  # torch DDP: micro-batches per worker and step
    global_micro_batches: int | None = None  # engine, matched: micro-batches per step, all workers and rounds
    rounds_per_step: int = 1  # engine: rounds per optimizer step (acco: 2)
    workers: int = 1

    @property
    def per_worker_round(self) -> int | None:
        """Micro-batches each worker runs in each round (matched engine modes)."""
        if self.global_micro_batches is None:
            return None
        return self.global_micro_batches // (self.rounds_per_step * self.workers)

    def describe(self) -> str:
        """One cell of the table: micro-batch and how many make a step."""
        if self.accumulation is not None:
            return f"{self.micro_batch} x acc {self.accumulation}"
        if self.global_micro_batches is not None:
            rounds = f" ({self.rounds_per_step} rounds)" if self.rounds_per_step > 1 else ""
            return f"{self.micro_batch} x {self.global_micro_batches}/step{rounds}"
        return f"{self.micro_batch} x grow"


def _strategy_class(strategy: str):
    import importlib

    from engine.strategies import STRATEGIES  # imports torch: only when a mode is planned

    module, name = STRATEGIES[strategy].split(":")
    return getattr(importlib.import_module(module), name)


def is_local_steps(strategy: str) -> bool:
    """Whether the engine's ``strategy`` takes inner steps alone between outer rounds."""
    from engine.strategies.local_steps import LocalStepStrategy

    return issubclass(_strategy_class(strategy), LocalStepStrategy)


def _rounds_per_step(strategy: str) -> int:
    """Rounds per optimizer step (the strategy's plan); a local-step strategy's optimizer step
    is an inner step, one batch (its outer rounds come every H of them)."""
    if is_local_steps(strategy):
        return 1
    return _strategy_class(strategy).plan.rounds_per_step


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def matched_batch(name: str, global_batch: int, workers: int, micro_batch: int) -> BatchPlan:
    """How mode ``name`` trains at ``global_batch`` samples per optimizer step on ``workers``
    workers, DDP at ``micro_batch`` (see the module docstring); BatchError if it cannot."""
    mode = MODES[name]
    if "matched" not in mode.protocols:
        raise BatchError(f"{name} chooses its own batch (free-batch protocol only): leave it out of a "
                         f"matched-batch run, or use --protocol free")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise BatchError(f"the global batch must be a positive number of samples, got {global_batch!r}")
    if mode.ddp is not None:
        per_acc = workers * micro_batch
        if global_batch % per_acc:
            ok = ", ".join(str(per_acc * k) for k in (1, 2, 4))
            raise BatchError(f"--global-batch {global_batch}: {name} runs {workers} workers at micro-batch "
                             f"{micro_batch}, so its global batch is accumulation x {per_acc} samples; "
                             f"choose a multiple of {per_acc} ({ok}, ...) or change --micro-batch")
        return BatchPlan(micro_batch, global_batch, accumulation=global_batch // per_acc, workers=workers)
    rounds = _rounds_per_step(mode.strategy)
    for m in _divisors_desc(micro_batch):
        if global_batch % m == 0 and (global_batch // m) % (rounds * workers) == 0:
            return BatchPlan(m, global_batch, global_micro_batches=global_batch // m, rounds_per_step=rounds,
                             workers=workers)
    split = f"{rounds} rounds per step x " if rounds > 1 else ""
    raise BatchError(f"--global-batch {global_batch}: {name} splits each step over {split}{workers} workers "
                     f"and every worker runs the same whole number of micro-batches (of a divisor of "
                     f"--micro-batch {micro_batch}) in every round, so the global batch must be a multiple "
                     f"of {rounds * workers}")


def free_batch(name: str, workers: int, micro_batch: int) -> BatchPlan:
    """How mode ``name`` takes its batch under the free protocol: DDP at its accumulation (1 when
    the mode leaves it to the protocol), engine modes grow theirs at ``micro_batch``."""
    mode = MODES[name]
    if mode.ddp is not None:
        acc = mode.ddp.accumulation or 1
        return BatchPlan(micro_batch, acc * workers * micro_batch, accumulation=acc, workers=workers)
    return BatchPlan(micro_batch, None, rounds_per_step=_rounds_per_step(mode.strategy), workers=workers)


# ------------------------------------------------------------------ the lr schedule
WARMUP_FRACTION = 0.05  # matched batch: linear warmup over the first 5% of the steps ...
MIN_LR_RATIO = 0.1  # ... then cosine down to 10% of the peak lr at the last step


@dataclass(frozen=True)
class LrSchedule:
    """One lr schedule for every mode: the engine runs it from its config (``engine_kwargs``),
    torch DDP through a torch.optim.lr_scheduler that asks :meth:`at` (benchmarks/worker.py);
    both end in :func:`acco_loco.schedule.lr_at`, so they follow the same numbers."""

    lr: float  # the peak lr
    total_steps: int  # the horizon: optimizer steps of the run
    warmup_steps: int = 0
    kind: str = "constant"  # acco_loco.schedule.SCHEDULES
    min_lr_ratio: float = 0.0

    def at(self, step: int) -> float:
        """The lr of optimizer step ``step`` (0-based)."""
        return lr_at(step, self.lr, self.kind, self.warmup_steps, self.total_steps, self.min_lr_ratio)

    def engine_kwargs(self) -> dict[str, Any]:
        """The EngineConfig fields that make the engine follow this schedule."""
        return {"lr": self.lr, "lr_schedule": self.kind, "warmup_steps": self.warmup_steps,
                "min_lr_ratio": self.min_lr_ratio, "max_steps": self.total_steps}


def matched_schedule(lr: float, steps: int) -> LrSchedule:
    """The matched-batch schedule over ``steps`` optimizer steps: warmup over 5% of them (at
    least one), then cosine to 10% of ``lr``."""
    if steps < 1:
        raise ValueError(f"the schedule needs at least one step, got {steps}")
    return LrSchedule(lr, steps, warmup_steps=max(1, round(WARMUP_FRACTION * steps)), kind="cosine",
                      min_lr_ratio=MIN_LR_RATIO)
