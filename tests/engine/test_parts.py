"""The engine's parts own their state: the loops, the strategies, the checkpoint, training-state,
dealing, progress, context and re-cut functions take the parts they need (LoopParts, a
RoundContext, a RunState, a PeriodicSaver, ParallelDims, ...), never the Engine; no module outside
engine/strategies/ names a strategy's checkpoint keys (each strategy declares how its state is
re-cut); and no source file is over 450 lines."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from engine.loops.parts import LoopParts
from engine.strategies.base import Strategy

ROOT = Path(__file__).resolve().parents[2]
# every module of engine/ but the Engine's own file, its re-export and the Trainer that holds one
NO_ENGINE = sorted(p for p in ROOT.glob("engine/**/*.py") if p.relative_to(ROOT).as_posix() not in
                   ("engine/__init__.py", "engine/engine.py", "engine/hf.py"))
ENGINE_NAMES = {"engine", "e", "eng"}  # what the engine was called when it was passed around


def _names_engine(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Engine":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Engine":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "Engine" in node.value.replace(
                "EngineConfig", "").replace("EngineState", ""):
            return True
    return False


def engine_parameters(source: str) -> list[str]:
    """'function(parameter)' for every parameter named like the engine or annotated Engine, and
    'import' for an import of the Engine class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
            name = getattr(node, "name", "<lambda>")
            found += [f"{name}({p.arg})" for p in params if p.arg in ENGINE_NAMES or _names_engine(p.annotation)]
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "Engine" for alias in node.names):
            found.append(f"import Engine from {node.module}")
    return found


def test_the_check_finds_an_engine_parameter():
    # the check below could fail: these are the shapes it catches
    assert engine_parameters("def f(engine): pass") == ["f(engine)"]
    assert engine_parameters("class L:\n    def __init__(self, e): pass") == ["__init__(e)"]
    assert engine_parameters("def g(x: 'Engine', *, y: EngineConfig): pass") == ["g(x)"]
    assert engine_parameters("from ..engine import Engine") == ["import Engine from engine"]
    assert engine_parameters("def h(parts, cfg: EngineConfig, state: EngineState): pass") == []


@pytest.mark.parametrize("path", NO_ENGINE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_takes_the_engine(path):
    assert engine_parameters(path.read_text()) == [], path


def test_make_loop_takes_the_parts():
    assert list(inspect.signature(Strategy.make_loop).parameters) == ["self", "parts"]
    fields = set(LoopParts.__dataclass_fields__)
    assert {"ctx", "strategy", "worker", "accumulation", "state", "run", "saver"} <= fields


def test_no_source_file_is_over_450_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for d in ("engine", "acco_loco") for p in (ROOT / d).rglob("*.py")}
    assert len(sizes) > 20  # the walk found the packages
    assert {p: n for p, n in sizes.items() if n > 450} == {}


def test_only_the_strategies_name_their_checkpoint_keys():
    """engine/checkpoint/reshard.py applies each strategy's ``recut_rules``; no module outside
    engine/strategies/ spells a strategy's state keys (a new strategy edits no other file)."""
    from engine.strategies import STRATEGIES, strategy_class

    keys = {k.rstrip(".") for name in STRATEGIES for k in strategy_class(name).recut_rules} - {"opt"}
    assert {"outer.theta_sync", "onebit.worker_error", "kept_grad_sum", "local_params"} <= keys
    outside = [p for p in ROOT.glob("engine/**/*.py") if "strategies" not in p.relative_to(ROOT).parts]
    named = {(str(p.relative_to(ROOT)), k) for p in outside for k in keys
             if f'"{k}' in p.read_text() or f"'{k}" in p.read_text()}  # a string literal that starts with it
    assert named == set()
