"""Ranks that would train different things stop at start, all of them, with the first rank and
the first parameter or setting that differs named (engine/agreement.py); gloo would otherwise
abort one process on mismatched sizes and leave the others waiting."""

from __future__ import annotations

import time

import pytest
import torch

from engine import Engine, EngineConfig
from engine.agreement import describe, first_difference
from engine.local_group import spawn
from tests.tiny import mse_loss, tiny_model


def _model(layers: int):
    torch.manual_seed(0)
    mods = [torch.nn.Linear(6, 16), torch.nn.Tanh()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(16, 3))


def _build(rank: int, world: int, strategy: str, per_rank: dict):
    kw = {"strategy": strategy, "max_steps": 2, "align": 8, "timeout_s": 30, "heartbeat_s": 1}
    kw.update(per_rank.get(rank, {}).get("cfg", {}))
    model = _model(per_rank.get(rank, {}).get("layers", 2))
    Engine(model, EngineConfig(**kw), mse_loss).close()
    return "built"


def _errors(strategy: str, per_rank: dict) -> tuple[list[str], float]:
    start = time.monotonic()
    try:
        spawn(_build, 2, strategy, per_rank, timeout=60)
    except AssertionError as exc:
        return [line for line in str(exc).splitlines() if line.startswith("rank ")], time.monotonic() - start
    return [], time.monotonic() - start


@pytest.mark.parametrize("strategy", ["zero1", "acco", "diloco"])
def test_a_different_model_stops_every_rank_and_names_the_parameter(strategy):
    errors, took = _errors(strategy, {1: {"layers": 3}})
    assert len(errors) == 2, errors  # both ranks raise, neither waits for the other
    assert all("rank 1 does not train what rank 0 trains: parameter '4.weight' is shape (16, 16)" in e for e in errors), errors
    assert took < 30


@pytest.mark.parametrize("strategy", ["zero1", "acco", "diloco"])
def test_a_different_setting_stops_every_rank_and_names_it(strategy):
    errors, _ = _errors(strategy, {1: {"cfg": {"lr": 1e-3}}})
    assert len(errors) == 2 and all("setting lr is 0.001 on rank 1 and 0.0003 on rank 0" in e for e in errors), errors


def test_same_training_starts_and_local_settings_may_differ():
    assert spawn(_build, 2, "zero1", {1: {"cfg": {"timeout_s": 60, "progress": False}}}) == ["built", "built"]


def test_first_difference_in_the_reference_order():
    a = describe(tiny_model(), EngineConfig())
    b = describe(tiny_model(), EngineConfig(codec="loco4"))
    assert first_difference(a, b) == ("setting codec", "'none'", "'loco4'")
    assert first_difference(a, a[:-1])[2] == "absent"
    assert first_difference(a[:-1], a)[1] == "absent"
