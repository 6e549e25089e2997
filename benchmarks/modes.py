"""The one table of training modes: a name -> how to train it.

Used by the benchmark (``recipes/benchmark.py``, ``benchmarks/worker.py``), by
``benchmarks/loco_quality.py`` and by ``tests/engine/test_loco_engine.py``; each picks the modes it runs
from here by name. A mode is either

* an engine mode: flat :class:`engine.EngineConfig` keyword arguments (``strategy``, ``codec``,
  ``param_codec`` and any further fields in ``extra``), see :meth:`Mode.engine_kwargs`; or
* a torch DDP variant: torch's own DistributedDataParallel + torch.optim.AdamW, with ``no_sync``
  accumulation of ``accumulation`` micro-batches and, optionally, the PowerSGD comm hook of
  matrix rank ``powersgd_rank`` (error feedback on).

The uncompressed engine modes send fp32 parameters (``param_codec="float32"``): every user of
this table trains in float32, where that is also what ``"auto"`` picks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class DdpVariant:
    accumulation: int  # micro-batches per step, all but the last under no_sync
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

    def engine_kwargs(self) -> dict[str, Any]:
        """The flat EngineConfig keyword arguments of an engine mode."""
        if self.ddp is not None:
            raise ValueError("a torch DDP variant has no engine configuration")
        return {"strategy": self.strategy, "codec": self.codec, "param_codec": self.param_codec,
                **self.extra}


def _engine(strategy: str, codec: str = "none", param_codec: str = "float32", **extra: Any) -> Mode:
    return Mode(strategy, codec, param_codec, extra)


def _ddp(accumulation: int, powersgd_rank: int | None = None) -> Mode:
    return Mode(ddp=DdpVariant(accumulation, powersgd_rank))


_ACCO_LOCO4_INT8 = _engine("acco", "loco4", "int8")

MODES: dict[str, Mode] = {
    # torch's DistributedDataParallel (the benchmark's baselines)
    "torch-ddp-acc1": _ddp(1),
    "torch-ddp-acc4": _ddp(4),
    "torch-ddp-acc12": _ddp(12),
    "torch-ddp+powersgd1": _ddp(1, powersgd_rank=1),
    "torch-ddp+powersgd4": _ddp(1, powersgd_rank=4),
    # this engine, uncompressed
    "zero1": _engine("zero1"),
    "dpu": _engine("dpu"),
    "acco": _engine("acco"),
    # this engine, compressed: LoCo 4-bit gradients + int8 / int4 parameter deltas
    "acco+loco4": _ACCO_LOCO4_INT8,
    "acco+loco4+int8": _ACCO_LOCO4_INT8,  # the same mode under loco_quality's name
    "acco+loco4+int4params": _engine("acco", "loco4", "int4"),
    # the shortest rounds: one micro-batch per round and worker, whatever the round costs (the
    # smallest ACCO batch, 2 x workers micro-batches per step; the comm side's CPU is not amortized)
    "acco+loco4+int4params+cap1": _engine("acco", "loco4", "int4", max_micro_batches=1,
                                          max_round_overhead=0.0),
    # plain 4-bit gradients (no error compensation), other gradient codecs
    "acco+int4": _engine("acco", "int4"),
    "acco+int4+int8": _engine("acco", "int4", "int8"),
    "dpu+ef8+bf16": _engine("dpu", "ef8", "bfloat16"),
}

# recipes/benchmark.py: every mode it can run, in its table's order (the default --modes) ...
BENCHMARK_MODES = ("torch-ddp-acc1", "torch-ddp-acc4", "torch-ddp-acc12", "torch-ddp+powersgd1",
                   "torch-ddp+powersgd4", "zero1", "dpu", "acco", "acco+loco4", "acco+loco4+int4params",
                   "acco+loco4+int4params+cap1")
# ... its default with --hetero ...
HETERO_MODES = ("torch-ddp-acc1", "torch-ddp-acc4", "torch-ddp-acc12", "torch-ddp+powersgd1",
                "torch-ddp+powersgd4", "zero1", "acco", "acco+loco4", "acco+loco4+int4params")
# ... and the mode whose final held-out loss is the target and whose figures the ratios divide by
REFERENCE = "torch-ddp-acc1"

# benchmarks/loco_quality.py: the modes it can run
QUALITY_MODES = ("zero1", "acco", "acco+loco4+int8", "acco+int4+int8")


def engine_modes(names) -> dict[str, dict[str, Any]]:
    """name -> EngineConfig keyword arguments, for engine modes picked from the table by name."""
    return {n: MODES[n].engine_kwargs() for n in names}
