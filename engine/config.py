"""EngineConfig: every knob of the engine, typed, with its default in code.

The settings live in sections, each a dataclass of ``setting(...)`` fields with its own RULES
table: the core ones in engine/sections.py, and each strategy's own (diloco and sparseloco's
``outer``, onebit_adam's ``onebit``) in a file beside the strategy, registered in
engine/strategies/__init__.py ``SECTIONS``. EngineConfig gathers them (``config_schema``): a new
strategy section changes nothing here."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from acco_loco.optim import OptimizerSpec
from acco_loco.schedule import validate_schedule

from .core.dtypes import GRAD_DTYPE_NODE_REFUSED
from .planner.goal import DEFAULT_GOAL, DEFAULT_LOSS_BOUND_PCT, GOALS
from .rules import Check, Choice, Rule, choice, integer, is_int, number, optional, setting
from .sections import (
    AccumulationConfig,
    CommunicationConfig,
    LayoutConfig,
    OptimizerConfig,
    RuntimeConfig,
    ScheduleConfig,
)
from .strategies import SECTIONS as STRATEGY_SECTIONS
from .strategies import STRATEGIES, optimizer_refused, section_class, section_readers, sections_read, strategy_class

NAN_POLICIES = ("skip", "stop")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
GRAD_DTYPES = ("auto", "float32", "compute")  # engine/core/dtypes.py resolves them
SEED_LIMIT = 2**32  # the codec generators seed with seed * 65537 + rank, which must fit 64 bits

# Fields that decide the trajectory's structure: a checkpoint refuses to resume under others.
STRUCTURAL_FIELDS = ("strategy", "optimizer", "compute_dtype", "align", "codec", "param_codec",
                     "group_size", "error_storage", "scale_dtype")

# The core sections by attribute name, in to_dict's order; the strategies' own sections
# (cfg.outer, ...) come between these and runtime.
CORE_SECTIONS = {"optim": OptimizerConfig, "schedule": ScheduleConfig, "accumulate": AccumulationConfig,
                 "comm": CommunicationConfig, "layout": LayoutConfig}
LAST_SECTIONS = {"runtime": RuntimeConfig}
# the flat keywords of earlier releases (and of the README's example) -> (section, field)
_RENAMED = {"optimizer": ("optim", "name"), "lr_schedule": ("schedule", "kind"),
            "accumulation": ("accumulate", "mode")}


class ConfigSchema(NamedTuple):
    """Every section and flat name of EngineConfig under the current strategy registry."""

    sections: dict[str, type]  # by attribute name, in to_dict's order
    strategy_sections: tuple[str, ...]  # those registered in engine/strategies SECTIONS
    flat: dict[str, tuple[str, str]]  # flat keyword -> (section, field)
    rules: dict[str, Rule]  # flat keyword or top-level field -> its rule


def config_schema() -> ConfigSchema:
    """The sections, flat names and rules; a section registered later (a test's) is picked up."""
    return _schema(tuple(STRATEGY_SECTIONS.items()))


@functools.lru_cache(maxsize=1)
def _schema(registry: tuple[tuple[str, str], ...]) -> ConfigSchema:
    own = {name: section_class(name) for name, _ in registry}
    sections = {**CORE_SECTIONS, **own, **LAST_SECTIONS}
    flat_name = {key: name for name, key in _RENAMED.items()}
    pairs = [(flat_name.get((sec, f.name), f.name), sec, f.name)
             for sec, cls in sections.items() for f in dataclasses.fields(cls)]
    names = [*_RULES, *(name for name, _, _ in pairs), *CORE_SECTIONS, *own, *LAST_SECTIONS]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise RuntimeError(f"the names {clash} are taken twice: a strategy section's name and its fields' "
                           f"names (engine/strategies SECTIONS: {sorted(own)}) must be new to EngineConfig")
    unruled = sorted(set(_RULES) ^ set(_TOP_DEFAULTS)) + sorted(
        f"{sec}.{name}" for sec, cls in sections.items()
        for name in {f.name for f in dataclasses.fields(cls)} ^ set(getattr(cls, "RULES", {})))
    if unruled:  # fails at import (or at a new section's first use): no field skips validation
        raise RuntimeError(f"fields and rules disagree on {unruled}: give every field exactly one rule (a "
                           "section's field in the section's RULES, a top-level one in engine/config.py _RULES)")
    rules = {**_RULES, **{name: sections[sec].RULES[field] for name, sec, field in pairs}}
    return ConfigSchema(sections, tuple(own), {name: (sec, field) for name, sec, field in pairs}, rules)


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
                            "momentum as 1 bit a value each way; auto = zero1 or acco and their codecs, "
                            "chosen at start by the planner from a probe of the links (engine/auto.py)")
    auto_goal: str = setting(DEFAULT_GOAL, "strategy=auto: what it decides by (engine/planner/goal.py): "
                             "loss_per_sample = the fastest mode whose measured loss per sample is within "
                             "auto_loss_bound_pct of AdamW's; time_to_loss = the least predicted time to AdamW's "
                             "loss; either way only modes with measured rows of their own")
    auto_loss_bound_pct: float = setting(DEFAULT_LOSS_BOUND_PCT, "strategy=auto, auto_goal=loss_per_sample: the "
                                         "most held-out loss above AdamW's at equal samples, in percent")
    auto_results: str | None = setting(None, "strategy=auto: the folder of the measured benchmark JSONs (the "
                                       "repository's docs/results); none = ./docs/results where it exists")
    max_steps: int = setting(1000, "committed optimizer steps (also the lr schedule's horizon)")
    compute_dtype: str = setting("auto", "dtype of forward/backward: auto = the model's dtype")
    grad_dtype: str = setting("auto", "dtype the gradient is accumulated over micro-batches in and sent in "
                              "uncompressed: auto = float32 where it costs no bytes (a gradient codec encodes it, "
                              "or a local-step strategy keeps it), the compute dtype where it travels uncompressed "
                              "(DDP's bf16 reduce) and under model_sharding='node' (FSDP2 hands each shard its "
                              "gradient in the parameters' dtype); float32 = always (Megatron's fp32 reduce); "
                              "compute = the compute dtype")
    nan_policy: str = setting("skip", "on a non-finite gradient or update: skip the step everywhere, or stop")
    seed: int = setting(0, "seed of the codecs' stochastic rounding")
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    accumulate: AccumulationConfig = dataclasses.field(default_factory=AccumulationConfig)
    comm: CommunicationConfig = dataclasses.field(default_factory=CommunicationConfig)
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def __init__(self, **kwargs: Any) -> None:
        lay = config_schema()
        for name, default in _TOP_DEFAULTS.items():
            object.__setattr__(self, name, kwargs.pop(name, default))
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
        flat = config_schema().flat
        if name in flat:  # only reached when normal lookup fails: the flat names
            section, field = flat[name]
            return getattr(object.__getattribute__(self, section), field)
        raise AttributeError(f"EngineConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        flat = config_schema().flat
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
    def field_names() -> list[str]:
        """Every setting by its flat name (the top-level fields and each section's)."""
        return list(_TOP_DEFAULTS) + list(config_schema().flat)

    def validate(self) -> None:
        """Type and range of every field (_RULES and each section's RULES), then the rules
        between fields.

        Runs at construction; call it again after assigning a field.
        """
        rules = config_schema().rules
        for name in self.field_names():
            rules[name](name, getattr(self, name))
        if self.max_micro_batches is not None and self.max_micro_batches < self.micro_batches:
            raise ValueError(f"max_micro_batches ({self.max_micro_batches}) is below micro_batches "
                             f"({self.micro_batches}): raise it or lower micro_batches")
        self._check_accumulation()
        if self.heartbeat_s * 3 > self.timeout_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be at most a third of timeout_s "
                             f"({self.timeout_s}) so that a lost peer is detected in time")
        for name in ("checkpoint_every", "checkpoint_every_s"):
            if getattr(self, name) not in (0, None) and self.checkpoint_dir is None:
                raise ValueError(f"{name} is set but checkpoint_dir is not: give a directory")
        # the math layer checks its own inputs too; both must accept what the table accepts
        validate_schedule(self.lr_schedule, self.warmup_steps, self.min_lr_ratio)
        self.optimizer_spec()
        self._check_unread_sections()
        self._check_matrix_optimizer()
        self.check_model_sharding()
        self._check_optimizer_offload()

    def _check_matrix_optimizer(self) -> None:
        """optimizer='muon' steps whole matrices: a strategy whose owner steps whole shards (under
        model_sharding='node' each matrix is gathered to one rank of its node), the whole spare
        (step_copy), and torch's Muon (torch >= 2.9)."""
        if self.optimizer != "muon":
            return
        why = optimizer_refused(self.strategy, self.optimizer)
        if why:
            raise ValueError(f"optimizer='muon' with strategy {self.strategy!r}: {why}; use zero1, dpu or acco "
                             "with Muon, or optimizer='adamw'")
        if self.step_copy == "piece":
            raise ValueError("step_copy='piece' with optimizer='muon': Muon steps whole matrices, which reach past "
                             "a piece's scratch, so its step is proposed into the whole spare: use step_copy='auto' "
                             "or 'whole'")
        # model_sharding='node' too: each matrix's rows gathered to one rank of its node for Newton-Schulz
        # in the round (engine/parallel/node_matrices.py), for every strategy the check above lets through
        import torch

        if not hasattr(torch.optim, "Muon"):
            raise ValueError(f"optimizer='muon' takes torch.optim.Muon's math, which torch {torch.__version__} "
                             "lacks: install torch >= 2.9")

    def _check_optimizer_offload(self) -> None:
        """optimizer_offload='cpu' needs the sharded optimizer's state (zero1, dpu, acco) or a
        local-step strategy's inner state (diloco, sparseloco, local_sgd) and an elementwise
        optimizer (engine/runtime/offload.py)."""
        if self.optimizer_offload == "none":
            return
        why = (getattr(strategy_class(self.strategy), "offload_refused", "its state is not a sharded optimizer's "
                       "shard") if self.strategy in STRATEGIES else None)
        if why:
            raise ValueError(f"optimizer_offload={self.optimizer_offload!r} with strategy {self.strategy!r}: {why}; "
                             "use zero1, dpu, acco, diloco, sparseloco or local_sgd with it, or "
                             "optimizer_offload='none'")
        why = optimizer_refused(self.strategy, self.optimizer, self.optimizer_offload)
        if why:
            raise ValueError(f"optimizer_offload={self.optimizer_offload!r} with optimizer={self.optimizer!r}: {why}; "
                             "use optimizer='adamw' or 'sgd', or optimizer_offload='none'")

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
        for name in config_schema().strategy_sections:
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

    def check_model_sharding(self) -> None:
        """model_sharding='node' needs the node layout and a strategy whose rounds work on local
        shards (engine/parallel/sharding.py); the strategy "auto" is checked once it has resolved."""
        if self.model_sharding == "none":
            return
        if self.grad_dtype == "float32" and self.compute_dtype == "bfloat16":
            raise ValueError(GRAD_DTYPE_NODE_REFUSED)
        if self.topology == "flat":
            raise ValueError("model_sharding='node' shards the model over each node's ranks and runs the exchange "
                             "across nodes on the local shards: it needs topology='auto' or 'two_level', not 'flat'")
        if self.accumulation == "grow":
            raise ValueError("model_sharding='node' runs a node's ranks in lockstep (FSDP2's collectives), so every "
                             "rank of a node must run the same micro-batches per round: use accumulation='fixed' "
                             "(global_micro_batches, or micro_batches per rank), not 'grow'")
        why = strategy_class(self.strategy).node_sharding_refused if self.strategy in STRATEGIES else None
        if why:
            raise ValueError(f"strategy {self.strategy!r} does not run with model_sharding='node' yet ({why}): use "
                             "zero1, dpu or acco with it, or model_sharding='none'")

    def optimizer_spec(self) -> OptimizerSpec:
        return OptimizerSpec(name=self.optimizer, betas=tuple(self.betas), eps=self.eps,
                             weight_decay=self.weight_decay, momentum=self.momentum,
                             nesterov=self.nesterov, muon_momentum=self.muon_momentum,
                             muon_nesterov=self.muon_nesterov, muon_ns_steps=self.muon_ns_steps,
                             muon_adjust_lr=self.muon_adjust_lr)

    def to_dict(self) -> dict:
        """Nested, JSON-ready (what a checkpoint's engine.json holds)."""
        d = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in vars(self).items()}
        d["optim"]["betas"] = list(self.betas)
        if self.checkpoint_dir is not None:
            d["runtime"]["checkpoint_dir"] = os.fspath(self.checkpoint_dir)  # JSON has no paths
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        """From ``to_dict``'s nested form, the flat keywords, or a mix."""
        if not isinstance(d, dict):
            raise ValueError(f"EngineConfig.from_dict needs a dict of fields, got {type(d).__name__}")
        d = dict(d)
        if isinstance(d.get("betas"), list):  # JSON has no tuples; anything else is validated as is
            d["betas"] = tuple(d["betas"])
        if isinstance(d.get("optim"), dict) and isinstance(d["optim"].get("betas"), list):
            d["optim"] = {**d["optim"], "betas": tuple(d["optim"]["betas"])}
        return cls(**d)


_TOP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                 if f.name not in CORE_SECTIONS and f.name not in LAST_SECTIONS}


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


# ------------------------------------------------------------------------ the top-level rules
class _StrategyChoice(Choice):
    """A strategy registered now (a test or a plugin may add one), or auto (engine/auto.py)."""

    def __init__(self) -> None:
        pass

    options = property(lambda self: (*STRATEGIES, "auto"))


_RULES: dict[str, Rule] = {  # the sections' fields bring theirs (their RULES)
    "strategy": _StrategyChoice(),
    "auto_goal": choice(GOALS),
    "auto_loss_bound_pct": number(0),
    "auto_results": optional(Check("a non-empty path", lambda v: isinstance(v, str) and v != ""),
                             "./docs/results where it exists"),
    "max_steps": integer(1),
    "compute_dtype": choice(COMPUTE_DTYPES),
    "grad_dtype": choice(GRAD_DTYPES),
    "nan_policy": choice(NAN_POLICIES),
    "seed": Check("an integer in [0, 2**32)", lambda v: is_int(v) and 0 <= v < SEED_LIMIT),
}

config_schema()  # checks at import that every field has exactly one rule, so none can skip validation


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
    lay = config_schema()
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
