"""EngineConfig: every knob of the engine, typed, with its default in code."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from acco_loco.optim import OPTIMIZERS, OptimizerSpec, finite_number as _finite
from acco_loco.registry import GRAD_CODECS, PARAM_CODECS, parse_grad_codec
from acco_loco.schedule import SCHEDULES, validate_schedule

from .rules import Check, Choice, Renamed, Rule, boolean, choice, integer, is_int, number, optional
from .strategies import STRATEGIES
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
OUTER_MOMENTUM_KINDS = ("nesterov", "heavy_ball")
PSEUDO_GRAD_DTYPES = ("float32", "bfloat16")
SPARSE_AGGREGATES = ("mean", "contributors")
TOPK_VALUE_BITS = (1, 2, 4, 8)  # what acco_loco/bitpack.py packs
MAX_TOPK_CHUNK = 2**16  # indices within a chunk fit 16 bits
SEED_LIMIT = 2**32  # the codec generators seed with seed * 65537 + rank, which must fit 64 bits


def setting(default: Any, help: str) -> Any:
    """A config field with its default and the one-line help that the recipes' flags show."""
    return dataclasses.field(default=default, metadata={"help": help})


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
class OuterConfig:
    """Local-step strategies (diloco, sparseloco; docs/DESIGN.md section 8): every worker takes
    inner optimizer steps alone, and an outer round merges them every inner_steps steps."""

    inner_steps: int = setting(15, "diloco/sparseloco: inner optimizer steps each worker takes alone "
                               "between outer rounds (H)")
    outer_lr: float = setting(0.7, "diloco/sparseloco: learning rate of the outer step on the averaged "
                              "pseudo-gradient (DiLoCo's 0.7)")
    outer_momentum: float = setting(0.9, "diloco: momentum of the outer SGD (DiLoCo's 0.9; 0 = none)")
    outer_momentum_kind: str = setting("nesterov", "diloco: nesterov (DiLoCo) or heavy_ball outer momentum")
    pseudo_grad_dtype: str = setting("float32", "diloco: dtype of the pseudo-gradient average on the wire")
    topk_density: float = setting(0.02, "sparseloco: fraction of each chunk's values sent (top-k by magnitude)")
    topk_chunk: int = setting(4096, "sparseloco: values per top-k chunk (indices take ceil(log2 chunk) bits)")
    topk_value_bits: int = setting(2, "sparseloco: bits per sent value (1 sign bit + magnitude bits)")
    sparse_error_beta: float = setting(0.95, "sparseloco: decay of the error-feedback accumulator")
    sparse_aggregate: str = setting("mean", "sparseloco: mean = sum over workers / R (the paper); "
                                    "contributors = per value, the mean over the workers that sent it (templar)")
    outer_overlap: bool = setting(False, "diloco/sparseloco: keep taking inner steps while the outer round "
                                  "travels, and merge its result one round later")
    outer_period_s: float | None = setting(None, "diloco/sparseloco: an outer round every this many seconds "
                                           "instead of every inner_steps (mixed-speed workers; weighted by "
                                           "samples); none = every inner_steps")


@dataclass
class OnebitConfig:
    """1-bit Adam (strategy onebit_adam, docs/DESIGN.md section 9): AdamW until the second moment
    is frozen, then the momentum travels as 1 bit a value each way."""

    onebit_warmup_steps: int | None = setting(None, "onebit_adam: AdamW steps before the second moment is "
                                              "frozen; none = when it has stabilised (onebit_window, "
                                              "onebit_tolerance, onebit_min_warmup, onebit_max_warmup_fraction)")
    onebit_window: int = setting(10, "onebit_adam, variance rule: compare the L1 norm of the bias-corrected "
                                 "second moment with its value this many AdamW steps earlier")
    onebit_tolerance: float = setting(0.05, "onebit_adam, variance rule: freeze once that norm moved by at most "
                                      "this fraction over the window")
    onebit_min_warmup: int = setting(20, "onebit_adam, variance rule: never freeze before this many AdamW steps")
    onebit_max_warmup_fraction: float = setting(0.25, "onebit_adam, variance rule: freeze at the latest after "
                                                "this fraction of max_steps")


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


SECTIONS = {"optim": OptimizerConfig, "schedule": ScheduleConfig, "accumulate": AccumulationConfig,
            "comm": CommunicationConfig, "layout": LayoutConfig, "outer": OuterConfig, "onebit": OnebitConfig,
            "runtime": RuntimeConfig}
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
    outer: OuterConfig = dataclasses.field(default_factory=OuterConfig)
    onebit: OnebitConfig = dataclasses.field(default_factory=OnebitConfig)
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
        self._check_accumulation()
        if self.heartbeat_s * 3 > self.timeout_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be at most a third of timeout_s "
                             f"({self.timeout_s}) so that a lost peer is detected in time")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every is set but checkpoint_dir is not: give a directory")
        # the math layer checks its own inputs too; both must accept what the table accepts
        validate_schedule(self.lr_schedule, self.warmup_steps, self.min_lr_ratio)
        self.optimizer_spec()

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
        _rename_old_values(d)
        if isinstance(d.get("betas"), list):  # JSON has no tuples; anything else is validated as is
            d["betas"] = tuple(d["betas"])
        if isinstance(d.get("optim"), dict) and isinstance(d["optim"].get("betas"), list):
            d["optim"] = {**d["optim"], "betas": tuple(d["optim"]["betas"])}
        return cls(**d)


def _rename_old_values(d: dict) -> None:
    """Values that earlier releases wrote into checkpoints under other names."""
    if d.get("accumulation") == "adaptive":
        d["accumulation"] = "grow"
    acc = d.get("accumulate")
    if isinstance(acc, dict) and acc.get("mode") == "adaptive":
        d["accumulate"] = {**acc, "mode": "grow"}


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


# One line per field: adding a field to EngineConfig means adding its rule here.
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
    "inner_steps": integer(1),
    "outer_lr": number(0, low_open=True),
    "outer_momentum": number(0, 1, high_open=True),
    "outer_momentum_kind": choice(OUTER_MOMENTUM_KINDS),
    "pseudo_grad_dtype": choice(PSEUDO_GRAD_DTYPES),
    "topk_density": number(0, 1, low_open=True),
    "topk_chunk": Check(f"an integer in [2, {MAX_TOPK_CHUNK}]", lambda v: is_int(v) and 2 <= v <= MAX_TOPK_CHUNK),
    "topk_value_bits": Check(f"one of {TOPK_VALUE_BITS}", lambda v: is_int(v) and v in TOPK_VALUE_BITS),
    "sparse_error_beta": number(0, 1),
    "sparse_aggregate": choice(SPARSE_AGGREGATES),
    "outer_overlap": boolean,
    "outer_period_s": optional(number(0, low_open=True), "every inner_steps"),
    "onebit_warmup_steps": optional(integer(1), "the variance rule decides"),
    "onebit_window": integer(1),
    "onebit_tolerance": number(0, low_open=True),
    "onebit_min_warmup": integer(1),
    "onebit_max_warmup_fraction": number(0, 1, low_open=True),
}

_unruled = set(EngineConfig.field_names()) ^ set(_RULES)
if _unruled:  # fails at import, so a new field cannot skip validation
    raise RuntimeError(f"EngineConfig fields and _RULES disagree on {sorted(_unruled)}: "
                       "give every field exactly one rule in engine/config.py")


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


def describe_settings() -> dict[str, Setting]:
    """Every setting of EngineConfig (flat names, sections in order) with its default, help and
    choices: what recipes generate their flags from."""
    found = [("engine", f) for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS]
    found += [(sec, f) for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    flat_name = {key: name for name, key in FLAT.items()}
    names = [(flat_name.get((sec, f.name), f.name), sec, f) for sec, f in found]
    return {name: Setting(name, sec, str(f.type), f.default, f.metadata["help"],
                          getattr(_RULES[name], "options", None)) for name, sec, f in names}
