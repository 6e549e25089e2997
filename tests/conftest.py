"""The suite's split into the README's fast set and the slow set (``python -m pytest -q -m slow``).

The tests listed in tests/slow_tests.txt are marked ``slow`` here: the longest multi-process
tests as measured with ``--durations``, each one of several of its kind (another world size,
another strategy or codec of the same check) whose representative stays in the fast set. CI
runs both sets (.ci/run). A listed test that no longer exists fails a whole-suite run, so a
rename cannot quietly move a slow test into the fast set.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def slow_test_ids() -> set[str]:
    """The node ids of tests/slow_tests.txt (one a line; '#' starts a comment)."""
    lines = (line.split("#", 1)[0].strip() for line in SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects by the marker
def pytest_collection_modifyitems(config, items):
    slow = slow_test_ids()
    found = set()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.listed_slow)
            found.add(item.nodeid)
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS and slow - found:
        raise pytest.UsageError(f"tests/slow_tests.txt names tests that do not exist: {sorted(slow - found)}; "
                                "update the list")
