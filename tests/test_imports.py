"""The packages import without circles: a module graph built from the source (ast, no imports
run) over acco_loco, engine and lm must be acyclic.

Every ``import`` statement counts, module level or inside a function: a lazy import only hides a
circle until the call order changes, and it still means each module needs the other. Imports
under ``if TYPE_CHECKING:`` do not count (they never run). ``from pkg import name`` is an edge to
``pkg.name`` when that is a module of ours, else to ``pkg``; importing ``a.b.c`` is an edge to
``a.b.c`` only (not to the parent packages Python runs first: a package's ``__init__`` that
imports its own submodules is not a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("acco_loco", "engine", "lm")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes anywhere in the tree, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search, sorted for a stable answer)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert "acco_loco.bitpack" in graph["acco_loco.codecs"]  # from .bitpack import ...
    assert "acco_loco.kernels" in graph["acco_loco.optim"]  # a lazy import inside a function
    assert "engine.engine" in graph["engine"]


def test_find_cycle_names_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# ------------------------------------------------------------------------------------------------
# strategy names are compared only inside engine/strategies/
# ------------------------------------------------------------------------------------------------

def _strategy_names() -> set[str]:
    from engine.strategies import STRATEGIES

    return set(STRATEGIES)


def _named_in(node: ast.AST, names: set[str]) -> str | None:
    """The strategy name a comparison operand is or holds (a literal, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and node.value in names:
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return next((e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names), None)
    return None


def strategy_comparisons(paths, names: set[str]) -> list[str]:
    """'file:line name' for every ==, !=, in, not in (also match-case) against a strategy name."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            operands = []
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.MatchValue):
                operands = [node.value]
            for op in operands:
                name = _named_in(op, names)
                if name is not None:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return found


# The planner is a cost model with one entry per strategy (what it sends, when it overlaps): its
# tables are about the strategies by name, as the README's tables are; it never runs a round.
MODELS_OF_STRATEGIES = (ROOT / "engine" / "strategies", ROOT / "engine" / "planner")


def test_no_strategy_name_compared_outside_the_strategies():
    names = _strategy_names()
    outside = [p for pkg in (*PACKAGES, "recipes") for p in sorted((ROOT / pkg).rglob("*.py"))
               if not any(d in p.parents for d in MODELS_OF_STRATEGIES)]
    found = strategy_comparisons(outside, names)
    assert not found, ("strategy names compared outside engine/strategies/ (let the strategy class "
                       "declare what it needs instead): " + ", ".join(found))


def test_the_name_check_sees_a_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(cfg):\n    return cfg.strategy == 'onebit_adam' or cfg.strategy in ('diloco',)\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert strategy_comparisons([probe], _strategy_names()) == ["probe.py:2 onebit_adam", "probe.py:2 diloco"]
    finally:
        ROOT = old


# ------------------------------------------------------------------------------------------------
# the engine owns the lifecycle; the strategy's loop decides what a boundary does
# ------------------------------------------------------------------------------------------------

def test_engine_py_stays_a_lifecycle_file():
    src = (ROOT / "engine" / "engine.py").read_text()
    assert len(src.splitlines()) <= 300, "engine/engine.py grew past 300 lines: move a job to its own file"
    tree = ast.parse(src)
    engine_cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine_cls.bases == [], "Engine mixes in a class: give the job to an object it owns"
    # no branch on the strategy's shape: the loop (engine/loops/) decides
    assert "local_steps" not in src
