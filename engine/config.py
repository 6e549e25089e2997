"""EngineConfig: every knob of the engine, typed, with its default in code."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from acco_loco.optim import OPTIMIZERS, OptimizerSpec, finite_number as _finite
from acco_loco.registry import PARAM_CODECS, parse_grad_codec
from acco_loco.schedule import SCHEDULES, validate_schedule

from .strategies import STRATEGIES  # names only: a strategy's module loads when first used

ACCUMULATION_MODES = ("adaptive", "fixed")
NAN_POLICIES = ("skip", "stop")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")

# Fields that decide the trajectory's structure: a checkpoint refuses to resume under others.
STRUCTURAL_FIELDS = ("strategy", "optimizer", "compute_dtype", "align", "codec", "param_codec",
                     "group_size", "error_storage", "scale_dtype")
ERROR_STORAGES = ("int8", "fp32")
SCALE_DTYPES = ("float32", "bfloat16")
SEED_LIMIT = 2**32  # the codec generators seed with seed * 65537 + rank, which must fit 64 bits


@dataclass
class OptimizerConfig:
    """The shard optimizer (one flat fp32 shard per worker)."""

    name: str = "adamw"  # adamw | sgd   (flat keyword: optimizer)
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    max_grad_norm: float | None = None  # global-norm clipping; None = off


@dataclass
class ScheduleConfig:
    """The learning rate over committed steps (its horizon is EngineConfig.max_steps)."""

    kind: str = "constant"  # constant | linear | cosine   (flat keyword: lr_schedule)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class AccumulationConfig:
    """How many micro-batches a round takes."""

    mode: str = "adaptive"  # adaptive | fixed   (flat keyword: accumulation)
    micro_batches: int = 1  # per round ("fixed") or the minimum per round ("adaptive")
    max_micro_batches: int | None = None  # adaptive: cap per round (keeps the batch small)
    # adaptive, CPU: raise the minimum per round so that the comm side's CPU per round stays
    # below this fraction of the round's compute (engine/pacing.py); 0 = off
    max_round_overhead: float = 0.15


@dataclass
class CommunicationConfig:
    """What goes on the wire and how (codecs: acco_loco/registry.py)."""

    codec: str = "none"  # gradients: none | int8/4/2 | ef8/4/2/1 | loco8/4/2/1 | sign1 | fp16
    param_codec: str = "auto"  # params: auto (compute dtype) | float32 | bfloat16 | int8 | int4 (deltas)
    group_size: int = 128  # values per quantization group (a multiple of 8)
    align: int = 128  # shards are multiples of this many values
    loco_beta: float = 0.8  # LoCo moving average of past errors
    reset_period: int = 1024  # committed steps between error resets
    error_storage: str = "int8"  # int8 (LoCo's 8-bit errors) | fp32
    scale_dtype: str = "float32"  # group scales on the wire: float32 | bfloat16
    stochastic_rounding: bool = False
    comm_chunks: int = 1  # split each collective into this many async pieces (gloo speed)


@dataclass
class RuntimeConfig:
    """Failure detection, checkpoints, progress and debugging."""

    timeout_s: float = 300.0  # a peer silent this long is reported as lost
    heartbeat_s: float = 1.0
    checkpoint_dir: str | os.PathLike | None = None  # to_dict stores it as a str
    checkpoint_every: int = 0  # committed steps between checkpoints; 0 = never
    progress: bool = False  # a progress bar on rank 0
    record_timeline: bool = False  # per-round timestamps in engine.timeline
    poison_freed_buffers: bool = False  # debug: NaN-fill gradient buffers once released
    keep_cpu_memory: bool = True  # CPU: glibc keeps freed memory (engine/cpu_memory.py)


SECTIONS = {"optim": OptimizerConfig, "schedule": ScheduleConfig, "accumulate": AccumulationConfig,
            "comm": CommunicationConfig, "runtime": RuntimeConfig}
# the flat keywords of earlier releases (and of the README's example) -> (section, field)
_RENAMED = {"optimizer": ("optim", "name"), "lr_schedule": ("schedule", "kind"),
            "accumulation": ("accumulate", "mode")}
FLAT: dict[str, tuple[str, str]] = {
    **{f.name: (sec, f.name) for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)
       if (sec, f.name) not in _RENAMED.values()},
    **_RENAMED}


@dataclass(init=False)
class EngineConfig:
    """Every knob of the engine, in typed sections with their defaults in the section classes.

    ``EngineConfig(strategy="acco", lr=3e-4, codec="loco4")`` takes the flat keywords (each
    routed to its section) as well as whole sections (``optim=OptimizerConfig(...)``), and
    ``cfg.lr`` reads ``cfg.optim.lr``. Unknown keywords are refused."""

    strategy: str = "acco"  # a key of engine/strategies STRATEGIES
    max_steps: int = 1000  # committed optimizer steps (also the lr schedule's horizon)
    compute_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16
    nan_policy: str = "skip"  # skip the step, or stop with an error
    seed: int = 0
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    accumulate: AccumulationConfig = dataclasses.field(default_factory=AccumulationConfig)
    comm: CommunicationConfig = dataclasses.field(default_factory=CommunicationConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def __init__(self, **kwargs: Any) -> None:
        for f in dataclasses.fields(self):
            value = kwargs.pop(f.name, dataclasses.MISSING)
            if f.name in SECTIONS:
                value = _section(f.name, value)
            elif value is dataclasses.MISSING:
                value = f.default
            object.__setattr__(self, f.name, value)
        unknown = sorted(set(kwargs) - set(FLAT))
        if unknown:
            raise ValueError(f"unknown EngineConfig fields {unknown}: the fields are "
                             f"{sorted(self.field_names())} (engine/config.py)")
        for name, value in kwargs.items():  # flat keywords, after the sections they refine
            setattr(self, name, value)
        self.validate()

    def __getattr__(self, name: str) -> Any:
        if name in FLAT:  # only reached when normal lookup fails: the flat names
            section, field = FLAT[name]
            return getattr(object.__getattribute__(self, section), field)
        raise AttributeError(f"EngineConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FLAT:
            section, field = FLAT[name]
            setattr(getattr(self, section), field, value)
        else:
            object.__setattr__(self, name, value)

    @staticmethod
    def field_names() -> list[str]:
        """Every setting by its flat name (the top-level fields and each section's)."""
        return [f.name for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS] + list(FLAT)

    def validate(self) -> None:
        """Type and range of every field (the table _RULES), then the rules between fields.

        Runs at construction; call it again after assigning a field.
        """
        for name in self.field_names():
            _RULES[name](name, getattr(self, name))
        if self.max_micro_batches is not None and self.max_micro_batches < self.micro_batches:
            raise ValueError(f"max_micro_batches ({self.max_micro_batches}) is below micro_batches "
                             f"({self.micro_batches}): raise it or lower micro_batches")
        if self.heartbeat_s * 3 > self.timeout_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be at most a third of timeout_s "
                             f"({self.timeout_s}) so that a lost peer is detected in time")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every is set but checkpoint_dir is not: give a directory")
        # the math layer checks its own inputs too; both must accept what the table accepts
        validate_schedule(self.lr_schedule, self.warmup_steps, self.min_lr_ratio)
        self.optimizer_spec()

    def optimizer_spec(self) -> OptimizerSpec:
        return OptimizerSpec(name=self.optimizer, betas=tuple(self.betas), eps=self.eps,
                             weight_decay=self.weight_decay, momentum=self.momentum,
                             nesterov=self.nesterov)

    def to_dict(self) -> dict:
        """Nested, JSON-ready (what a checkpoint's engine.json holds)."""
        d = dataclasses.asdict(self)
        d["optim"]["betas"] = list(self.betas)
        if self.checkpoint_dir is not None:
            d["runtime"]["checkpoint_dir"] = os.fspath(self.checkpoint_dir)  # JSON has no paths
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        """From ``to_dict``'s nested form, the flat form of earlier checkpoints, or a mix."""
        if not isinstance(d, dict):
            raise ValueError(f"EngineConfig.from_dict needs a dict of fields, got {type(d).__name__}")
        d = dict(d)
        if isinstance(d.get("betas"), list):  # JSON has no tuples; anything else is validated as is
            d["betas"] = tuple(d["betas"])
        if isinstance(d.get("optim"), dict) and isinstance(d["optim"].get("betas"), list):
            d["optim"] = {**d["optim"], "betas": tuple(d["optim"]["betas"])}
        return cls(**d)


def _section(name: str, value: Any):
    """A section from a section object, a dict of its fields, or its defaults."""
    cls = SECTIONS[name]
    if value is dataclasses.MISSING:
        return cls()
    if isinstance(value, cls):
        return dataclasses.replace(value)  # a copy: configs never share a section
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}: see engine/config.py")
        return cls(**value)
    raise ValueError(f"{name} must be {cls.__name__}(...) or a dict of its fields, got {value!r}")


# ------------------------------------------------------------------------ the per-field rules
Rule = Callable[[str, Any], None]  # (field name, value) -> None, or raises ValueError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class _Rule:
    """What one field accepts: ``ok`` decides, ``allowed`` says it in the error message."""

    allowed: str
    ok: Callable[[Any], bool]

    def __call__(self, name: str, value: Any) -> None:
        if not self.ok(value):
            raise ValueError(f"{name} must be {self.allowed}, got {value!r}")


def _int(minimum: int) -> _Rule:
    """An int (not a bool, not a float) >= minimum."""
    allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    return _Rule(allowed, lambda v: _is_int(v) and v >= minimum)


def _float(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False,
           note: str = "") -> _Rule:
    """A finite int or float (not a bool) in the interval; ``note`` says what a value means."""
    if high == math.inf:
        allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        allowed = f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if note:
        allowed += f" ({note})"

    def ok(v: Any) -> bool:
        return (_finite(v) and (v > low if low_open else v >= low)
                and (v < high if high_open else v <= high))

    return _Rule(allowed, ok)


def _optional(rule: _Rule, none_means: str) -> _Rule:
    return _Rule(f"None ({none_means}) or {rule.allowed}", lambda v: v is None or rule.ok(v))


def _choice(options: tuple[str, ...] | list[str]) -> Rule:
    def check(name: str, value: Any) -> None:
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"unknown {name} {value!r}: choose one of {options}")

    return check


_bool = _Rule("True or False (a bool, not 0/1 or a string)", lambda v: isinstance(v, bool))

_betas = _Rule("a pair (beta1, beta2) of finite numbers in [0, 1)",
               lambda v: isinstance(v, (tuple, list)) and len(v) == 2
               and all(_finite(b) and 0 <= b < 1 for b in v))

_seed = _Rule("an integer in [0, 2**32)", lambda v: _is_int(v) and 0 <= v < SEED_LIMIT)

_group_size = _Rule("a positive multiple of 8", lambda v: _is_int(v) and v > 0 and v % 8 == 0)

_checkpoint_dir = _Rule("None or a non-empty path (a str or os.PathLike)",
                        lambda v: v is None or isinstance(v, (str, os.PathLike))
                        and isinstance(os.fspath(v), str) and os.fspath(v) != "")


def _codec(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a codec name such as 'none', 'int8' or 'loco4', got {value!r}")
    parse_grad_codec(value)  # its message lists the valid names


def _param_codec(name: str, value: Any) -> None:
    _choice(PARAM_CODECS)(name, value)


# One line per field: adding a field to EngineConfig means adding its rule here.
_RULES: dict[str, Rule] = {
    "strategy": _choice(sorted(STRATEGIES)),
    "micro_batches": _int(1),
    "accumulation": _choice(ACCUMULATION_MODES),
    "max_micro_batches": _optional(_int(1), "no cap"),
    "max_round_overhead": _float(0, 1, high_open=True, note="0 turns it off"),
    "max_steps": _int(1),
    "optimizer": _choice(tuple(OPTIMIZERS)),
    "lr": _float(0, low_open=True),
    "betas": _betas,
    "eps": _float(0, low_open=True),
    "weight_decay": _float(0),
    "momentum": _float(0, 1, high_open=True),
    "nesterov": _bool,
    "max_grad_norm": _optional(_float(0, low_open=True), "no clipping"),
    "lr_schedule": _choice(SCHEDULES),
    "warmup_steps": _int(0),
    "min_lr_ratio": _float(0, 1),
    "compute_dtype": _choice(COMPUTE_DTYPES),
    "align": _int(1),
    "nan_policy": _choice(NAN_POLICIES),
    "seed": _seed,
    "codec": _codec,
    "param_codec": _param_codec,
    "group_size": _group_size,
    "loco_beta": _float(0, 1, high_open=True),
    "reset_period": _int(1),
    "error_storage": _choice(ERROR_STORAGES),
    "scale_dtype": _choice(SCALE_DTYPES),
    "stochastic_rounding": _bool,
    "timeout_s": _float(0, low_open=True),
    "heartbeat_s": _float(0, low_open=True),
    "comm_chunks": _int(1),
    "checkpoint_dir": _checkpoint_dir,
    "checkpoint_every": _int(0),
    "progress": _bool,
    "record_timeline": _bool,
    "poison_freed_buffers": _bool,
    "keep_cpu_memory": _bool,
}

_unruled = set(EngineConfig.field_names()) ^ set(_RULES)
if _unruled:  # fails at import, so a new field cannot skip validation
    raise RuntimeError(f"EngineConfig fields and _RULES disagree on {sorted(_unruled)}: "
                       "give every field exactly one rule in engine/config.py")
