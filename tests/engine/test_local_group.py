"""engine/parallel/local_group.py's ranks see what a spawned rank would: the caller's environment
at the call (not the forkserver's from when it started), their rank's variables, and a fresh
import of the project (a setting read at import follows the caller). Real processes."""

from __future__ import annotations

import os

from engine.parallel.local_group import spawn, spawn_collect

# read when a rank imports this module to unpickle its function: it must see the caller's environment
AT_IMPORT = os.environ.get("ACL_TEST_SECOND")


def environment(rank: int, world: int, names: list[str]) -> dict:
    return {"env": {n: os.environ.get(n) for n in names}, "rank": os.environ["RANK"], "at_import": AT_IMPORT}


def pid(rank: int, world: int) -> int:
    return os.getpid()


def fails(rank: int, world: int):
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    return "ok"


def test_ranks_take_the_callers_environment_at_each_call(monkeypatch):
    monkeypatch.setenv("ACL_TEST_FIRST", "1")
    first = spawn(environment, 2, ["ACL_TEST_FIRST", "ACL_TEST_SECOND"])
    assert [r["env"] for r in first] == [{"ACL_TEST_FIRST": "1", "ACL_TEST_SECOND": None}] * 2
    assert [r["rank"] for r in first] == ["0", "1"]
    # after the server runs: a variable set and one removed since are seen as the caller has them now
    monkeypatch.setenv("ACL_TEST_SECOND", "2")
    monkeypatch.delenv("ACL_TEST_FIRST")
    names = ["ACL_TEST_FIRST", "ACL_TEST_SECOND", "ACL_TEST_THIRD"]
    second = spawn(environment, 2, names, env={"ACL_TEST_THIRD": "3"})  # env: set on top, as before
    assert [r["env"] for r in second] == [{"ACL_TEST_FIRST": None, "ACL_TEST_SECOND": "2", "ACL_TEST_THIRD": "3"}] * 2
    assert [r["at_import"] for r in first + second] == [None, None, "2", "2"]


def test_every_call_gets_new_processes_and_failures_are_reported():
    assert len(set(spawn(pid, 2) + spawn(pid, 2))) == 4
    out = spawn_collect(fails, 2, timeout=60)
    assert out[0]["status"] == "ok" and out[0]["exitcode"] == 0
    assert out[1]["status"] == "error" and "rank 1 fails on purpose" in out[1]["out"]
    assert out[1]["exitcode"] == 1
