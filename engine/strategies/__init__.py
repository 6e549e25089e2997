"""Data-parallel strategies, one file each, by config name. A new strategy is a file with a
``Strategy`` subclass plus a line here ("module:Class", imported when first used, so the config
can check names without importing the runtime)."""

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


def strategy_class(name: str):
    """The ``Strategy`` subclass registered as ``name`` (a key of STRATEGIES)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {sorted(STRATEGIES)}")
    module, cls_name = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls_name)


def make_strategy(cfg):
    """A fresh strategy object for ``cfg.strategy`` (a key of STRATEGIES), checked against cfg."""
    cls = strategy_class(cfg.strategy)
    cls.check(cfg)
    build = getattr(cls, "from_config", None)  # a strategy whose plan depends on the config
    return build(cfg) if build is not None else cls()
