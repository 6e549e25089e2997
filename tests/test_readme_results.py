"""Every number on the README's results table is in a JSON under docs/results.

The table is the first one under "## Results". Each row's figures must all be found in one mode
record of the JSONs that the section names before the table (all of docs/results when it names
none), at the row's link rate: a record's own figures (its top-level numbers, and the numbers of
its top-level lists and dicts, e.g. ``loss_vs_ref_pct_per_seed``), not the per-step or per-run
series under them. A figure matches a JSON value that rounds to it at the printed digits, in the
table's units: "%" is a percent field's value (a key with "pct"), a column headed MB is bytes /
1e6.
No torch: this reads text and JSON only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"
LABELS = {"link", "mode"}  # columns that name the row, not figures
NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?%?")
RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kMG])bit/s")
UNITS = {"kB": 1e-3, "MB": 1e-6, "GB": 1e-9}


def results_section(text: str) -> tuple[str, list[str]]:
    """(the text before the table, the table's lines) of the README's "## Results" section."""
    section = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[:start]), lines[start:end]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def rate_of(label: str) -> str | None:
    """'100 Mbit/s' -> '100mbit', the benchmark's spelling of a link rate."""
    m = RATE.search(label)
    return f"{m.group(1)}{m.group(2).lower()}bit" if m else None


def figures(value) -> list[tuple[str, float]]:
    """A record's own numbers, each with its key: its scalars and those of its lists and dicts of
    scalars."""
    out = []
    for k, v in value.items():
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else [v]
        out += [(k, float(x)) for x in items if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return out


def records(doc, rate: str | None = None) -> list[tuple[str | None, list[tuple[str, float]]]]:
    """(rate, figures) of every dict with a "mode" in ``doc``; a record without a rate takes the
    nearest enclosing one (a config's or the document's)."""
    found = []

    def walk(node, inherited):
        if isinstance(node, dict):
            config = node.get("config") if isinstance(node.get("config"), dict) else {}
            here = next((r for r in (node.get("rate"), config.get("rate")) if isinstance(r, str)), inherited)
            if "mode" in node:
                found.append((here, figures(node)))
            for v in node.values():
                walk(v, here)
        elif isinstance(node, list):
            for v in node:
                walk(v, inherited)

    walk(doc, rate)
    return found


def matches(figure: str, header: str, values: list[tuple[str, float]]) -> bool:
    """Whether ``figure`` (as printed in the column ``header``) rounds from one of ``values``: a
    percentage from a percent field (a key with "pct": the benchmark's ``loss_vs_ref_pct`` and its
    per-seed values); bytes as MB (kB, GB) where the header says so; any other figure as it is."""
    text = figure.rstrip("%")
    digits = len(text.split(".")[1]) if "." in text else 0
    x, tol = float(text), 0.5 * 10 ** -digits + 1e-12
    if figure.endswith("%"):
        return any(abs(v - x) <= tol for k, v in values if "pct" in k)
    scales = [1.0] + [s for unit, s in UNITS.items() if unit in header]
    return any(abs(v * s - x) <= tol for _, v in values for s in scales)


def check(text: str, results: Path = RESULTS) -> list[str]:
    """What is wrong with ``text``'s results table: one line per figure not found."""
    before, table = results_section(text)
    named = sorted(set(re.findall(r"docs/results/([\w.+-]+\.json)", before)))
    paths = [results / n for n in named] or sorted(results.glob("*.json"))
    missing_files = [str(p.relative_to(ROOT)) for p in paths if not p.exists()]
    if missing_files:
        return [f"the results section names {f}, which does not exist" for f in missing_files]
    recs = [r for p in paths for r in records(json.loads(p.read_text()))]
    header = cells(table[0])
    problems = []
    assert len(table) > 2, "the README's results table has no rows"
    for line in table[2:]:
        row = dict(zip(header, cells(line)))
        label = " ".join(v for k, v in row.items() if k.lower() in LABELS)
        rate = rate_of(label)
        wanted = [(figure, k) for k, v in row.items() if k.lower() not in LABELS
                  for figure in NUMBER.findall(v.replace("*", ""))]
        if not wanted:
            continue
        candidates = [vals for r, vals in recs if rate is None or r == rate]
        if not candidates:
            problems.append(f"row '{line.strip()}': no mode record at rate {rate} in {named or 'docs/results'}")
            continue
        # the record that holds the most of the row's figures; every figure must be in it
        best = max(candidates, key=lambda vals: sum(matches(f, k, vals) for f, k in wanted))
        problems += [f"{f} (column '{k}') of row '{line.strip()}' is in no JSON record at {rate} "
                     f"of {', '.join(named) or 'docs/results'} (with the row's other figures)"
                     for f, k in wanted if not matches(f, k, best)]
    return problems


def test_every_number_on_the_readme_results_table_is_in_a_json():
    problems = check(README.read_text())
    assert not problems, "\n".join(problems)


def test_a_changed_number_is_caught():
    """The check can fail: a figure moved by 3 in its last digit is reported with its row."""
    text = README.read_text()
    _, table = results_section(text)
    row = table[2]
    figure = next(f for c in cells(row)[1:] for f in NUMBER.findall(c.replace("*", "")) if "." in f)
    digits = len(figure.rstrip("%").split(".")[1])
    bumped = f"{float(figure.rstrip('%')) + 3 * 10 ** -digits:.{digits}f}" + ("%" if figure.endswith("%") else "")
    changed = text.replace(row, row.replace(figure, bumped, 1), 1)
    problems = check(changed)
    assert any(bumped in p and row.replace(figure, bumped, 1).strip() in p for p in problems), problems
