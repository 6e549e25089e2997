"""EngineConfig: every knob of the engine, typed, with its default in code."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from acco_loco.optim import OPTIMIZERS, OptimizerSpec, finite_number as _finite
from acco_loco.registry import GRAD_CODECS, PARAM_CODECS, parse_grad_codec
from acco_loco.schedule import SCHEDULES, validate_schedule

from .rules import Check, Choice, Renamed, Rule, boolean, choice, integer, is_int, number, optional, setting
from .strategies import SECTIONS as STRATEGY_SECTIONS
from .strategies import STRATEGIES, section_class, section_readers, sections_read
from .topology import TOPOLOGIES  # names only: a strategy's module loads when first used

ACCUMULATION_MODES = ("fixed", "grow")
BALANCES = ("equal", "speed")
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

    name: str = setting("adamw", "shard optimizer")  # flat keyword: optimizer
    lr: float = setting(3e-4, "peak learning rate")
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW's (beta1, beta2)")
    eps: float = setting(1e-8, "AdamW's epsilon")
    weight_decay: float = setting(0.0, "decoupled weight decay")
    momentum: float = setting(0.9, "SGD momentum")
    nesterov: bool = setting(False, "SGD: Nesterov momentum")
    max_grad_norm: float | None = setting(None, "clip the global gradient norm to this; none = no clipping")


@dataclass
class ScheduleConfig:
    """The learning rate over committed steps (its horizon is EngineConfig.max_steps)."""

    kind: str = setting("constant", "lr after warmup: constant, or a linear / cosine decay to "
                        "min_lr_ratio x lr at max_steps")  # flat keyword: lr_schedule
    warmup_steps: int = setting(0, "steps of linear lr warmup")
    min_lr_ratio: float = setting(0.0, "the decay's final lr as a fraction of lr")


@dataclass
class AccumulationConfig:
    """How many micro-batches a step and each of its rounds take."""

    mode: str = setting("fixed", "fixed = the batch you set, every step (global_micro_batches, or "
                        "micro_batches per worker and round); grow = keep accumulating while the "
                        "round in flight is still on the wire, so the batch grows with the link's "
                        "delay (at least micro_batches, at most max_micro_batches per round)")  # flat keyword: accumulation
    global_micro_batches: int | None = setting(
        None, "fixed: micro-batches per optimizer step, all workers and rounds together (the global "
        "batch is this times the micro-batch size; acco splits it over its estimate and commit "
        "rounds); none = micro_batches per worker and round")
    balance: str = setting("equal", "with global_micro_batches: how a round's micro-batches are shared "
                           "out: equal, or speed = in proportion to each worker's measured speed "
                           "(mixed GPUs; the step's batch stays the same)")
    micro_batches: int = setting(1, "micro-batches per worker and round (fixed without "
                                 "global_micro_batches), or the minimum per round (grow)")
    max_micro_batches: int | None = setting(None, "grow: the most micro-batches per round; none = no cap")
    # grow, CPU: raise the minimum per round so that the comm side's CPU per round stays
    # below this fraction of the round's compute (engine/pacing.py)
    max_round_overhead: float = setting(0.15, "grow on CPU (acco, dpu): raise the minimum micro-batches "
                                        "per round until the comm side's CPU per round is at most this "
                                        "fraction of the round's compute (0 = off: rounds end when the "
                                        "one in flight is done)")


@dataclass
class CommunicationConfig:
    """What goes on the wire and how (codecs: acco_loco/registry.py)."""

    codec: str = setting("none", "gradients on the wire: none (uncompressed), int<bits> (plain), "
                         "ef<bits> (classic error feedback), loco<bits> (LoCo error compensation), "
                         "sign1 (sign x RMS), fp16")
    param_codec: str = setting("auto", "parameter updates on the wire: auto (the compute dtype), "
                               "float32, bfloat16, or int8/int4 deltas")
    group_size: int = setting(128, "values per quantization group (a multiple of 8)")
    align: int = setting(128, "shards are multiples of this many values")
    loco_beta: float = setting(0.8, "LoCo: weight of the moving average of past errors")
    reset_period: int = setting(1024, "committed steps between error-feedback resets")
    error_storage: str = setting("int8", "how error feedback is stored: int8 (LoCo's 8-bit errors) or fp32")
    scale_dtype: str = setting("float32", "dtype of the group scales on the wire")
    stochastic_rounding: bool = setting(False, "quantize with stochastic instead of nearest rounding")
    comm_chunks: int = setting(1, "split each collective into this many async pieces (gloo speed)")


@dataclass
class LayoutConfig:
    """Where the ranks sit and which exchange runs over them (engine/topology.py)."""

    topology: str = setting("auto", "auto = two-level when the run has at least 2 nodes of at least 2 ranks "
                            "(a full-precision reduce-scatter inside each node, then only the node's sum "
                            "crosses the network, 1/G per rank over its rail), flat otherwise; flat = one "
                            "exchange over all ranks; two_level = insist on it")
    ranks_per_node: int | None = setting(None, "ranks per node (G); none = the launcher's LOCAL_WORLD_SIZE "
                                         "(torchrun, accelerate launch), or 1 when it is not set")


@dataclass
class RuntimeConfig:
    """Failure detection, checkpoints, progress and debugging."""

    timeout_s: float = setting(300.0, "seconds a silent peer may take before it is reported as lost")
    heartbeat_s: float = setting(1.0, "seconds between liveness heartbeats (at most timeout_s / 3)")
    checkpoint_dir: str | os.PathLike | None = setting(None, "where checkpoints go (to_dict stores a str)")
    checkpoint_every: int = setting(0, "committed steps between checkpoints (0 = never)")
    progress: bool = setting(False, "a progress bar on rank 0")
    record_timeline: bool = setting(False, "per-round timestamps in engine.timeline")
    poison_freed_buffers: bool = setting(False, "debug: NaN-fill gradient buffers once released")
    keep_cpu_memory: bool = setting(True, "CPU: glibc keeps freed memory (engine/cpu_memory.py)")


# The core sections, by attribute name, in to_dict's order; the strategies' own sections
# (engine/strategies/__init__.py SECTIONS, e.g. cfg.outer) come between them and runtime.
CORE_SECTIONS = {"optim": OptimizerConfig, "schedule": ScheduleConfig, "accumulate": AccumulationConfig,
                 "comm": CommunicationConfig, "layout": LayoutConfig}
LAST_SECTIONS = {"runtime": RuntimeConfig}
# the flat keywords of earlier releases (and of the README's example) -> (section, field)
_RENAMED = {"optimizer": ("optim", "name"), "lr_schedule": ("schedule", "kind"),
            "accumulation": ("accumulate", "mode")}


@dataclass(frozen=True)
class Layout:
    """Every section and flat name of EngineConfig under the current strategy registry."""

    sections: dict[str, type]  # by attribute name, in to_dict's order
    strategy_sections: tuple[str, ...]  # those of engine/strategies SECTIONS
    flat: dict[str, tuple[str, str]]  # flat keyword -> (section, field)
    rules: dict[str, Rule]  # flat keyword or top-level field -> its rule


_layout_cache: dict[tuple, Layout] = {}


def layout() -> Layout:
    """The sections and their rules, the registered strategy sections loaded by name (a section
    registered later, e.g. by a test, is picked up by the next call)."""
    key = tuple(STRATEGY_SECTIONS.items())
    if key not in _layout_cache:
        _layout_cache.clear()
        _layout_cache[key] = _build_layout()
    return _layout_cache[key]


def _build_layout() -> Layout:
    own = {name: section_class(name) for name in STRATEGY_SECTIONS}
    sections = {**CORE_SECTIONS, **own, **LAST_SECTIONS}
    top = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in sections]
    clash = set(own) & (set(top) | set(CORE_SECTIONS) | set(LAST_SECTIONS))
    flat_name = {key: name for name, key in _RENAMED.items()}
    flat: dict[str, tuple[str, str]] = {}
    rules = dict(_RULES)
    for sec, cls in sections.items():
        names = [f.name for f in dataclasses.fields(cls)]
        if sec in own:
            if set(names) ^ set(getattr(cls, "RULES", {})):
                raise RuntimeError(f"section {sec!r} ({cls.__module__}.{cls.__name__}) and its RULES disagree on "
                                   f"{sorted(set(names) ^ set(getattr(cls, 'RULES', {})))}: give every field "
                                   "exactly one rule in its RULES table")
            rules.update(cls.RULES)
        for name in names:
            flat_key = flat_name.get((sec, name), name)
            if flat_key in flat or flat_key in top:
                clash.add(flat_key)
            flat[flat_key] = (sec, name)
    if clash:
        raise RuntimeError(f"the strategy sections {sorted(own)} reuse the names {sorted(clash)}: a section's "
                           "name and its fields' names must be new to EngineConfig")
    unruled = (set(top) | set(flat)) ^ set(rules)
    if unruled:  # fails at import (or at the first use of a new section): no field skips validation
        raise RuntimeError(f"EngineConfig fields and _RULES disagree on {sorted(unruled)}: give every field "
                           "exactly one rule in engine/config.py (a strategy section's: in its RULES)")
    return Layout(sections, tuple(own), flat, rules)


@dataclass(init=False, eq=False, repr=False)
class EngineConfig:
    """Every knob of the engine, in typed sections with their defaults in the section classes.

    ``EngineConfig(strategy="acco", lr=3e-4, codec="loco4")`` takes the flat keywords (each
    routed to its section) as well as whole sections (``optim=OptimizerConfig(...)``), and
    ``cfg.lr`` reads ``cfg.optim.lr``. Unknown keywords are refused. Besides the core sections
    declared here, every section registered in engine/strategies/__init__.py SECTIONS is one
    (``cfg.outer``, ``cfg.inner_steps``)."""

    strategy: str = setting("acco", "zero1 = synchronous ZeRO-1; dpu = delayed parameter update (one "
                            "step stale); acco = estimate + commit rounds that overlap communication "
                            "with compute; local_sgd = parameter averaging every round; diloco = inner AdamW "
                            "steps alone, outer Nesterov SGD on the averaged pseudo-gradient every "
                            "inner_steps; sparseloco = the same with error feedback and a top-k 2-bit "
                            "pseudo-gradient; onebit_adam = 1-bit Adam: AdamW warmup, then the frozen-variance "
                            "momentum as 1 bit a value each way; auto = zero1, dpu or acco and their codecs, "
                            "chosen at start by the planner from a probe of the links (engine/auto.py)")
    max_steps: int = setting(1000, "committed optimizer steps (also the lr schedule's horizon)")
    compute_dtype: str = setting("auto", "dtype of forward/backward: auto = the model's dtype")
    nan_policy: str = setting("skip", "on a non-finite gradient or update: skip the step everywhere, or stop")
    seed: int = setting(0, "seed of the codecs' stochastic rounding")
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    accumulate: AccumulationConfig = dataclasses.field(default_factory=AccumulationConfig)
    comm: CommunicationConfig = dataclasses.field(default_factory=CommunicationConfig)
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def __init__(self, **kwargs: Any) -> None:
        lay = layout()
        for name in self.top_level_names():
            object.__setattr__(self, name, kwargs.pop(name, _TOP_DEFAULTS[name]))
        for name, cls in lay.sections.items():
            object.__setattr__(self, name, _section(name, cls, kwargs.pop(name, dataclasses.MISSING)))
        unknown = sorted(set(kwargs) - set(lay.flat))
        if unknown:
            raise ValueError(f"unknown EngineConfig fields {unknown}: the fields are "
                             f"{sorted(self.field_names())} (engine/config.py)")
        for name, value in kwargs.items():  # flat keywords, after the sections they refine
            setattr(self, name, value)
        self.validate()

    def __getattr__(self, name: str) -> Any:
        flat = layout().flat
        if name in flat:  # only reached when normal lookup fails: the flat names
            section, field = flat[name]
            return getattr(object.__getattribute__(self, section), field)
        raise AttributeError(f"EngineConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        flat = layout().flat
        if name in flat:
            section, field = flat[name]
            setattr(getattr(self, section), field, value)
        else:
            object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"EngineConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    @staticmethod
    def top_level_names() -> list[str]:
        """The settings that belong to no section (strategy, max_steps, ...)."""
        return list(_TOP_DEFAULTS)

    @staticmethod
    def field_names() -> list[str]:
        """Every setting by its flat name (the top-level fields and each section's)."""
        return EngineConfig.top_level_names() + list(layout().flat)

    def validate(self) -> None:
        """Type and range of every field (the table _RULES and each strategy section's RULES),
        then the rules between fields.

        Runs at construction; call it again after assigning a field.
        """
        rules = layout().rules
        for name in self.field_names():
            rules[name](name, getattr(self, name))
        if self.max_micro_batches is not None and self.max_micro_batches < self.micro_batches:
            raise ValueError(f"max_micro_batches ({self.max_micro_batches}) is below micro_batches "
                             f"({self.micro_batches}): raise it or lower micro_batches")
        self._check_accumulation()
        if self.heartbeat_s * 3 > self.timeout_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be at most a third of timeout_s "
                             f"({self.timeout_s}) so that a lost peer is detected in time")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every is set but checkpoint_dir is not: give a directory")
        # the math layer checks its own inputs too; both must accept what the table accepts
        validate_schedule(self.lr_schedule, self.warmup_steps, self.min_lr_ratio)
        self.optimizer_spec()
        self._check_unread_sections()

    def _check_accumulation(self) -> None:
        """The batch settings that only make sense together (the world-size check is Engine's)."""
        grow = self.accumulation == "grow"
        if self.global_micro_batches is not None and grow:
            raise ValueError("global_micro_batches fixes the batch but accumulation='grow' grows it: "
                             "leave global_micro_batches=None, or use accumulation='fixed'")
        if self.global_micro_batches is not None and self.micro_batches != 1:
            raise ValueError(f"set one of micro_batches ({self.micro_batches}, per worker and round) and "
                             f"global_micro_batches ({self.global_micro_batches}, per step for all workers): "
                             "leave micro_batches at 1 when the global batch is set")
        if self.balance == "speed" and self.global_micro_batches is None:
            raise ValueError("balance='speed' shares out a global batch: set global_micro_batches too")
        if not grow and self.max_micro_batches is not None:
            raise ValueError("max_micro_batches caps accumulation='grow'; with 'fixed' every round takes "
                             "exactly its share: leave max_micro_batches=None")

    def _check_unread_sections(self) -> None:
        """A strategy section set away from its defaults under a strategy that does not read it
        would be ignored: refuse it, naming the strategies that read it (their classes are
        imported only here, when such a setting is set)."""
        for name in layout().strategy_sections:
            section = getattr(self, name)
            defaults = type(section)()
            changed = [f"{f.name}={getattr(section, f.name)!r}" for f in dataclasses.fields(section)
                       if getattr(section, f.name) != getattr(defaults, f.name)]
            if changed and name not in sections_read(self.strategy):
                readers = section_readers(name)
                who = f"strategy {' or '.join(map(repr, readers))} reads it" if readers else "no strategy reads it"
                raise ValueError(f"{', '.join(changed)} set, but strategy {self.strategy!r} does not read the "
                                 f"{name!r} section they belong to ({who}): choose such a strategy or leave "
                                 "them at their defaults")

    def optimizer_spec(self) -> OptimizerSpec:
        return OptimizerSpec(name=self.optimizer, betas=tuple(self.betas), eps=self.eps,
                             weight_decay=self.weight_decay, momentum=self.momentum,
                             nesterov=self.nesterov)

    def to_dict(self) -> dict:
        """Nested, JSON-ready (what a checkpoint's engine.json holds)."""
        d = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in vars(self).items()}
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
        _rename_old_values(d)
        if isinstance(d.get("betas"), list):  # JSON has no tuples; anything else is validated as is
            d["betas"] = tuple(d["betas"])
        if isinstance(d.get("optim"), dict) and isinstance(d["optim"].get("betas"), list):
            d["optim"] = {**d["optim"], "betas": tuple(d["optim"]["betas"])}
        return cls(**d)


_TOP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                 if f.name not in CORE_SECTIONS and f.name not in LAST_SECTIONS}


def _rename_old_values(d: dict) -> None:
    """Values that earlier releases wrote into checkpoints under other names."""
    if d.get("accumulation") == "adaptive":
        d["accumulation"] = "grow"
    acc = d.get("accumulate")
    if isinstance(acc, dict) and acc.get("mode") == "adaptive":
        d["accumulate"] = {**acc, "mode": "grow"}


def _section(name: str, cls: type, value: Any):
    """A section from a section object, a dict of its fields, or its defaults."""
    if value is dataclasses.MISSING:
        return cls()
    if isinstance(value, cls):
        return dataclasses.replace(value)  # a copy: configs never share a section
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}: see {cls.__module__}")
        return cls(**value)
    raise ValueError(f"{name} must be {cls.__name__}(...) or a dict of its fields, got {value!r}")


# ------------------------------------------------------------------------ the per-field rules
_betas = Check("a pair (beta1, beta2) of finite numbers in [0, 1)",
               lambda v: isinstance(v, (tuple, list)) and len(v) == 2
               and all(_finite(b) and 0 <= b < 1 for b in v))

_seed = Check("an integer in [0, 2**32)", lambda v: is_int(v) and 0 <= v < SEED_LIMIT)

_group_size = Check("a positive multiple of 8", lambda v: is_int(v) and v > 0 and v % 8 == 0)

_checkpoint_dir = Check("None or a non-empty path (a str or os.PathLike)",
                        lambda v: v is None or isinstance(v, (str, os.PathLike))
                        and isinstance(os.fspath(v), str) and os.fspath(v) != "")


class _GradCodecChoice(Choice):
    def __call__(self, name: str, value: Any) -> None:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a codec name such as 'none', 'int8' or 'loco4', got {value!r}")
        parse_grad_codec(value)  # its message lists the valid names


# One line per field of the core sections: adding one means adding its rule here (a strategy's
# own section brings its RULES table).
_RULES: dict[str, Rule] = {
    "strategy": choice(tuple(STRATEGIES) + ("auto",)),  # auto: engine/auto.py resolves it at start
    "micro_batches": integer(1),
    "accumulation": Renamed(ACCUMULATION_MODES, {"adaptive": "grow"}),
    "global_micro_batches": optional(integer(1), "micro_batches per worker and round"),
    "balance": choice(BALANCES),
    "max_micro_batches": optional(integer(1), "no cap"),
    "max_round_overhead": number(0, 1, high_open=True, note="0 turns it off"),
    "max_steps": integer(1),
    "optimizer": choice(tuple(OPTIMIZERS)),
    "lr": number(0, low_open=True),
    "betas": _betas,
    "eps": number(0, low_open=True),
    "weight_decay": number(0),
    "momentum": number(0, 1, high_open=True),
    "nesterov": boolean,
    "max_grad_norm": optional(number(0, low_open=True), "no clipping"),
    "lr_schedule": choice(SCHEDULES),
    "warmup_steps": integer(0),
    "min_lr_ratio": number(0, 1),
    "compute_dtype": choice(COMPUTE_DTYPES),
    "align": integer(1),
    "nan_policy": choice(NAN_POLICIES),
    "seed": _seed,
    "codec": _GradCodecChoice(tuple(GRAD_CODECS)),
    "param_codec": choice(PARAM_CODECS),
    "group_size": _group_size,
    "loco_beta": number(0, 1, high_open=True),
    "reset_period": integer(1),
    "error_storage": choice(ERROR_STORAGES),
    "scale_dtype": choice(SCALE_DTYPES),
    "stochastic_rounding": boolean,
    "timeout_s": number(0, low_open=True),
    "heartbeat_s": number(0, low_open=True),
    "comm_chunks": integer(1),
    "topology": choice(TOPOLOGIES),
    "ranks_per_node": optional(integer(1), "the launcher's LOCAL_WORLD_SIZE"),
    "checkpoint_dir": _checkpoint_dir,
    "checkpoint_every": integer(0),
    "progress": boolean,
    "record_timeline": boolean,
    "poison_freed_buffers": boolean,
    "keep_cpu_memory": boolean,
}

layout()  # checks at import that every field has exactly one rule, so none can skip validation


# ------------------------------------------------------------------------ settings, described
@dataclass(frozen=True)
class Setting:
    """One setting by its flat name, as a command line shows it."""

    name: str
    section: str  # the EngineConfig section it lives in ("engine" for the top-level fields)
    type: str  # the annotation as written: "int", "float | None", "bool", ...
    default: Any
    help: str
    choices: tuple[str, ...] | None  # a closed set of names, else None
    # a strategy's own section: the strategies that read it (their help starts with their
    # names); () for the core settings, which every strategy reads
    read_by: tuple[str, ...] = ()


def describe_settings() -> dict[str, Setting]:
    """Every setting of EngineConfig (flat names, sections in order) with its default, help and
    choices: what recipes generate their flags from. The settings of a strategy's own section
    say which strategies read it (this imports the registered strategies' classes)."""
    lay = layout()
    flat_name = {key: name for name, key in lay.flat.items()}
    found = [("engine", f.name, f) for f in dataclasses.fields(EngineConfig) if f.name not in lay.sections]
    found += [(sec, flat_name[sec, f.name], f) for sec, cls in lay.sections.items() for f in dataclasses.fields(cls)]
    readers = {sec: section_readers(sec) for sec in lay.strategy_sections}
    out = {}
    for sec, name, f in found:
        by = readers.get(sec, ())
        text = f"{'/'.join(by) or 'no strategy'}: {f.metadata['help']}" if sec in readers else f.metadata["help"]
        out[name] = Setting(name, sec, str(f.type), f.default, text, getattr(lay.rules[name], "options", None), by)
    return out
