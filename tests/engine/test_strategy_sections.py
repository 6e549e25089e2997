"""A strategy's own settings are a section beside it (engine/strategies/outer_config.py,
onebit_config.py): a dataclass with its RULES, registered by a line in engine/strategies SECTIONS,
read by the strategies that name it in their class attribute ``sections``. EngineConfig and the
recipe's flags pick a registered section up with nothing changed in engine/config.py: here a toy
section and a toy strategy from tests/ (toy_section.py, toy_strategy.py), registered for a test.
A section's setting away from its default under a strategy that does not read it is refused."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
from pathlib import Path

import pytest

import engine.strategies as registry
from engine import Engine, EngineConfig
from engine.config import config_schema, describe_settings
from tests.tiny import mse_loss, tiny_model, worker_stream

ROOT = Path(__file__).resolve().parents[2]


def _reload_recipe():
    """recipes/finetune.py generates its flags when imported: again under the current registry."""
    from recipes import finetune

    return importlib.reload(finetune)


@pytest.fixture
def toy():
    """The toy strategy and its section, registered by their two lines, then taken out again."""
    registry.SECTIONS["toy"] = "tests.toy_section:ToyConfig"
    registry.STRATEGIES["toy_zero1"] = "tests.toy_strategy:ToyZero1"
    try:
        yield _reload_recipe()
    finally:
        del registry.SECTIONS["toy"], registry.STRATEGIES["toy_zero1"]
        _reload_recipe()


# ------------------------------------------------------------------------ the registered sections
def test_outer_and_onebit_are_sections_beside_their_strategies():
    lay = config_schema()
    assert lay.strategy_sections == ("outer", "diloco", "sparseloco", "onebit", "acco")
    for name in lay.strategy_sections:
        assert lay.sections[name].__module__ == f"engine.strategies.{name}_config"
    assert list(EngineConfig().to_dict()) == ["strategy", "auto_goal", "auto_loss_bound_pct", "auto_results",
                                              "max_steps", "compute_dtype", "grad_dtype", "nan_policy",
                                              "seed", "optim", "schedule", "accumulate", "comm", "layout", "outer",
                                              "diloco", "sparseloco", "onebit", "acco", "runtime"]
    cfg = EngineConfig(strategy="sparseloco", inner_steps=5, sparseloco={"topk_chunk": 64})
    assert (cfg.inner_steps, cfg.outer.inner_steps, cfg.topk_chunk, cfg.sparseloco.topk_density) == (5, 5, 64, 0.02)
    settings = describe_settings()
    assert settings["inner_steps"].read_by == ("diloco", "sparseloco")
    assert settings["inner_steps"].help.startswith("diloco/sparseloco: ")
    assert settings["topk_chunk"].read_by == ("sparseloco",) and settings["outer_momentum"].read_by == ("diloco",)
    assert settings["onebit_window"].read_by == ("onebit_adam",) and settings["onebit_window"].section == "onebit"
    assert settings["lr"].read_by == ()
    declared = {f.name for f in dataclasses.fields(EngineConfig)}  # the core: no strategy section there
    assert not declared & {"outer", "diloco", "sparseloco", "onebit", "acco"}
    assert "OuterConfig" not in (ROOT / "engine" / "config.py").read_text()


def test_a_config_with_settings_in_a_section_that_does_not_hold_them_is_refused():
    """diloco's settings live in the ``diloco`` section: put in ``outer`` they are named as unknown
    there (no shim moves them: the configuration must say what it means)."""
    old = EngineConfig(strategy="diloco").to_dict()
    old["outer"].update(old.pop("diloco"))
    with pytest.raises(ValueError, match=r"unknown OuterConfig fields \['outer_momentum'"):
        EngineConfig.from_dict(old)


def test_section_files_import_neither_torch_nor_the_runtime():
    for name in ("outer_config", "diloco_config", "sparseloco_config", "onebit_config"):
        tree = ast.parse((ROOT / "engine" / "strategies" / f"{name}.py").read_text())
        imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                    for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in node.names}
        assert imported <= {"__future__", "dataclasses", "typing", "rules"}, (name, imported)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"inner_steps": 5}, "inner_steps=5 set, but strategy 'acco' does not read the 'outer' section they belong "
                         "to (strategy 'diloco' or 'sparseloco' reads it)"),
    ({"strategy": "zero1", "outer": {"outer_overlap": True, "outer_lr": 0.5}},
     "outer_lr=0.5, outer_overlap=True set, but strategy 'zero1'"),
    ({"strategy": "diloco", "onebit_window": 3}, "onebit_window=3 set, but strategy 'diloco' does not read the "
                                                  "'onebit' section they belong to (strategy 'onebit_adam' reads it)"),
    ({"strategy": "auto", "onebit_warmup_steps": 2}, "strategy 'auto' does not read the 'onebit' section"),
    ({"strategy": "diloco", "topk_chunk": 32}, "topk_chunk=32 set, but strategy 'diloco' does not read the "
                                               "'sparseloco' section they belong to (strategy 'sparseloco' reads it)"),
    ({"strategy": "sparseloco", "outer_momentum": 0.5}, "outer_momentum=0.5 set, but strategy 'sparseloco' does "
                                                        "not read the 'diloco' section"),
])
def test_a_setting_the_strategy_does_not_read_is_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        EngineConfig.from_dict(kwargs)


def test_defaults_of_an_unread_section_are_fine_and_reads_are_accepted():
    EngineConfig(strategy="acco", inner_steps=15, onebit_window=10)  # the defaults, as a recipe passes them
    EngineConfig(strategy="diloco", inner_steps=5, outer_momentum=0.5)  # the outer section and its own
    EngineConfig(strategy="sparseloco", inner_steps=5, topk_chunk=32)
    EngineConfig(strategy="onebit_adam", onebit_warmup_steps=3)
    cfg = EngineConfig(strategy="diloco", inner_steps=5)
    cfg.strategy = "acco"  # an assignment is checked by validate
    with pytest.raises(ValueError, match="strategy 'acco' does not read the 'outer' section"):
        cfg.validate()


# ------------------------------------------------------------------------ a toy strategy section
def test_a_registered_section_gets_flat_keywords_rules_and_round_trips(toy):
    assert "toy" in config_schema().strategy_sections and "toy_factor" in EngineConfig.field_names()
    cfg = EngineConfig(strategy="toy_zero1", toy_factor=0.5)
    assert (cfg.toy_factor, cfg.toy.toy_factor, cfg.toy_mode) == (0.5, 0.5, "plain")
    assert EngineConfig(strategy="toy_zero1", toy={"toy_mode": "fancy"}).toy_mode == "fancy"
    for kwargs, fragment in [({"toy_factor": 0}, "toy_factor must be a finite number in (0, 1], got 0"),
                             ({"toy_factor": float("nan")}, "toy_factor must be a finite number in (0, 1], got nan"),
                             ({"toy_mode": "odd"}, "unknown toy_mode 'odd': choose one of ('plain', 'fancy')"),
                             ({"toy": {"toy_speed": 2}}, "unknown ToyConfig fields ['toy_speed']")]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            EngineConfig(strategy="toy_zero1", **kwargs)
    cfg.toy_factor = 2.0
    with pytest.raises(ValueError, match=re.escape("toy_factor must be a finite number in (0, 1], got 2.0")):
        cfg.validate()
    cfg.toy_factor = 0.5
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["toy"] == {"toy_factor": 0.5, "toy_mode": "plain"} and list(d)[-2:] == ["toy", "runtime"]
    assert EngineConfig.from_dict(d) == cfg
    assert EngineConfig.from_dict({"strategy": "toy_zero1", "toy_factor": 0.5}) == cfg  # a flat dict
    assert EngineConfig() != EngineConfig(strategy="toy_zero1", toy_factor=0.5)
    with pytest.raises(ValueError, match=re.escape("toy_factor=0.5 set, but strategy 'acco' does not read the 'toy' "
                                                   "section they belong to (strategy 'toy_zero1' reads it)")):
        EngineConfig(toy_factor=0.5)
    with pytest.raises(ValueError, match=re.escape("inner_steps=3 set, but strategy 'toy_zero1'")):
        EngineConfig(strategy="toy_zero1", inner_steps=3)


def test_the_toy_strategy_reads_its_section_and_trains(toy):
    engine = Engine(tiny_model(0), EngineConfig(strategy="toy_zero1", toy_factor=0.25, toy_mode="fancy",
                                                max_steps=2, lr=1e-2), mse_loss)
    try:
        assert (engine.strategy.factor, engine.strategy.mode) == (0.25, "fancy")
        history = engine.fit(iter(worker_stream(0, 4)))
        assert [h["step"] for h in history] == [1, 2]
    finally:
        engine.close()


def test_a_registered_section_is_in_the_recipe_flags(toy):
    finetune = toy
    settings = describe_settings()
    assert settings["toy_factor"].section == "toy" and settings["toy_factor"].read_by == ("toy_zero1",)
    actions = {a.dest: a for a in finetune.build_parser()._actions}
    assert actions["toy_factor"].default == 1.0 and actions["toy_factor"].help == "toy_zero1: the toy's factor"
    assert actions["toy_mode"].choices == ("plain", "fancy")
    assert "toy_zero1" in actions["strategy"].choices
    groups = {g.title: g for g in finetune.build_parser()._action_groups}
    assert {a.dest for a in groups["engine: toy (strategy toy_zero1)"]._group_actions} == {"toy_factor", "toy_mode"}
    assert "read only by strategy toy_zero1" in groups["engine: toy (strategy toy_zero1)"].description
    assert "engine: outer (strategy diloco, sparseloco)" in groups
    ecfg = finetune.engine_config(finetune.parse_args(["--strategy", "toy_zero1", "--toy-factor", "0.5"]),
                                  "float32", Path("/tmp/ckpt"))
    assert ecfg.toy.toy_factor == 0.5
    with pytest.raises(finetune.RecipeError, match="toy_factor=0.5 set, but strategy 'auto'.*'toy_zero1' reads it"):
        finetune.engine_config(finetune.parse_args(["--toy-factor", "0.5"]), "float32", Path("/tmp/ckpt"))
    with pytest.raises(finetune.RecipeError, match="inner_steps=5 set, but strategy 'auto'"):
        finetune.engine_config(finetune.parse_args(["--inner-steps", "5"]), "float32", Path("/tmp/ckpt"))


@pytest.mark.parametrize("section, fragment", [
    ("UnruledConfig", "fields and rules disagree on ['bad.toy_forgotten']"),
    ("ClashingConfig", "the names ['lr'] are taken twice"),
])
def test_a_section_without_a_rule_per_field_or_with_a_taken_name_is_refused(section, fragment):
    registry.SECTIONS["bad"] = f"tests.toy_section:{section}"
    try:
        with pytest.raises(RuntimeError, match=re.escape(fragment)):
            EngineConfig()
    finally:
        del registry.SECTIONS["bad"]
    EngineConfig()  # the registry as it was
