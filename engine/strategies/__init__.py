"""Data-parallel strategies, one file each, by config name. A new strategy is a file with a
``Strategy`` subclass plus a line here ("module:Class", imported when first used, so the config
can check names without importing the runtime).

A strategy with settings of its own also has a section: a dataclass of ``setting(...)`` fields
with its ``RULES`` table, in a file of its own that imports neither torch nor the runtime
(outer_config.py, diloco_config.py, sparseloco_config.py, onebit_config.py), plus a line in
``SECTIONS``; the strategy class names the
sections it reads (``sections = ("outer",)``). EngineConfig picks every registered section up
(its flat keywords, rules, to_dict/from_dict and the recipes' flags); nothing in
engine/config.py changes."""

from __future__ import annotations

import importlib

STRATEGIES: dict[str, str] = {
    "zero1": "engine.strategies.zero1:Zero1",
    "dpu": "engine.strategies.dpu:DelayedUpdate",
    "acco": "engine.strategies.acco:Acco",
    "local_sgd": "engine.strategies.local_sgd:LocalSGD",
    "diloco": "engine.strategies.diloco:DiLoCo",
    "sparseloco": "engine.strategies.sparseloco:SparseLoCo",
    "onebit_adam": "engine.strategies.onebit_adam:OnebitAdam",
}

# the strategies' own config sections, by section name (EngineConfig's attribute: cfg.outer)
SECTIONS: dict[str, str] = {
    "outer": "engine.strategies.outer_config:OuterConfig",  # diloco, sparseloco
    "diloco": "engine.strategies.diloco_config:DilocoConfig",  # diloco
    "sparseloco": "engine.strategies.sparseloco_config:SparselocoConfig",  # sparseloco
    "onebit": "engine.strategies.onebit_config:OnebitConfig",  # onebit_adam
    "acco": "engine.strategies.acco_config:AccoConfig",  # acco
}


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def strategy_class(name: str):
    """The ``Strategy`` subclass registered as ``name`` (a key of STRATEGIES)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {sorted(STRATEGIES)}")
    return _load(STRATEGIES[name])


def optimizer_refused(strategy: str, optimizer: str, offload: str = "none") -> str | None:
    """Why ``strategy`` cannot step with ``optimizer`` (with its state on the CPU when ``offload`` is
    'cpu'), or None. Muon steps whole matrices: it needs a strategy whose owner steps a whole shard,
    on the device. EngineConfig refuses these runs and the planner leaves them out, by this one rule."""
    if optimizer != "muon":
        return None
    why = strategy_class(strategy).whole_matrices_refused if strategy in STRATEGIES else None
    if why:
        return why
    if offload != "none":
        return "stepping Muon's whole matrices on the CPU is not built"
    return None


def section_class(name: str):
    """The dataclass of the section registered as ``name`` (a key of SECTIONS); it imports no torch."""
    return _load(SECTIONS[name])


def sections_read(strategy: str) -> tuple[str, ...]:
    """The sections of SECTIONS that strategy ``strategy`` reads (its class's ``sections``); none
    for a name that is not registered ("auto" resolves to a strategy that reads none)."""
    return tuple(strategy_class(strategy).sections) if strategy in STRATEGIES else ()


def section_readers(section: str) -> tuple[str, ...]:
    """The registered strategies that read ``section``, in registry order (imports them all)."""
    return tuple(name for name in STRATEGIES if section in sections_read(name))


def shard_groups(cfg) -> list[int]:
    """The group sizes every shard must be a multiple of: the configured codecs' (one parser,
    acco_loco/registry.py ``parse_codecs``) and the strategy's own wire codecs' (1-bit Adam's)."""
    from acco_loco.registry import parse_codecs  # torch: only when an engine is built

    codecs = parse_codecs(cfg.codec, cfg.param_codec, cfg.group_size, cfg.scale_dtype)
    return codecs.groups() + strategy_class(cfg.strategy).codec_groups(cfg)


def make_strategy(cfg):
    """A fresh strategy object for ``cfg.strategy`` (a key of STRATEGIES), checked against cfg."""
    cls = strategy_class(cfg.strategy)
    cls.check(cfg)
    build = getattr(cls, "from_config", None)  # a strategy whose plan depends on the config
    return build(cfg) if build is not None else cls()
