"""The README is a front page and the docs hold together: the README stays short and keeps the
quick start's two commands, every relative link and #anchor in README.md and docs/ resolves, and
code cites a topic file under docs/, never a DESIGN section number (those moved once already)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(text: str) -> set[str]:
    anchors, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.*)$", line)):
            anchors.add(_anchor(m.group(1)))
    return anchors


def _docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move detail into a docs/ topic file"
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in quick.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert commands[0].endswith("recipes/finetune.py --output-dir out")
    assert commands[1].endswith("python -m pytest -q")
    assert "python -m pytest -q -m slow" in text  # how to run the slow set


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in _docs():
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _headings(dest.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_code_cites_topic_files_not_section_numbers():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    # a section number, or a part named in the old single design file: docs/DESIGN.md is an index now
    numbered = re.compile(r"DESIGN(\.md)?,?\s+(sections?\s+\d|\d|[\"A-Z])")
    cited = re.compile(r"docs/[\w/]+\.md")
    found, missing = [], []
    for name in files:
        text = (ROOT / name).read_text()
        found += [f"{name}: {m.group(0)}" for m in numbered.finditer(text)]
        missing += [f"{name}: {m.group(0)}" for m in cited.finditer(text) if not (ROOT / m.group(0)).exists()]
    assert not found, "cite the topic file under docs/ instead:\n" + "\n".join(found)
    assert not missing, "cited docs files that do not exist:\n" + "\n".join(missing)
