"""The planner checks host memory as well as the GPU's: an offloaded optimizer's or outer state's
host bytes per GPU against a node's host memory over its GPUs (``--host-mem-gib``, default a DGX
H100's 2048 GiB per 8-GPU node), at issue 41's layout (70B on 8 nodes x 8 H100s, bf16)."""

from __future__ import annotations

import json

import pytest

from engine.plan import main

ARGS = ["--model", "70b", "--nodes", "8", "--gpus-per-node", "8", "--inter-gbit", "1", "--global-batch", "1024",
        "--micro-batch", "1"]
ROW = "sparseloco-h15 [2-level, node-sharded, optimizer on CPU, outer state on CPU]"


def _rows(tmp_path, *extra: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(ARGS + list(extra) + ["--json", str(out)]) == 0
    return {r["mode"]: r for r in json.loads(out.read_text())["rows"]}


def test_a_row_out_of_host_memory_does_not_fit_and_says_so(tmp_path, capsys):
    # a node of 1024 GiB: the row's ~200 GiB of host per GPU (its outer round in pieces) is over 128
    rows = _rows(tmp_path, "--host-mem-gib", "1024")
    host = rows[ROW]["memory"]["host"]
    assert rows[ROW]["memory_bytes"] + rows[ROW]["activation_bytes"] <= 79.6 * 2**30  # the GPU would hold it
    assert host > 1024 * 2**30 / 8 and not rows[ROW]["fits"]
    assert f"no: host {host / 2**30:.3g} of 128 GiB" in capsys.readouterr().out
    # rows that keep their state on the GPU are not touched by the host check
    assert rows["zero1 [2-level, node-sharded]"]["fits"]


def test_more_host_memory_lets_it_in_and_zero_checks_nothing(tmp_path):
    host = _rows(tmp_path)[ROW]["memory"]["host"]
    per_node_gib = host * 8 / 2**30
    assert _rows(tmp_path, "--host-mem-gib", f"{per_node_gib * 1.01:.0f}")[ROW]["fits"]
    assert not _rows(tmp_path, "--host-mem-gib", f"{per_node_gib * 0.99:.0f}")[ROW]["fits"]
    assert _rows(tmp_path, "--host-mem-gib", "0")[ROW]["fits"]


def test_a_negative_host_memory_is_refused():
    with pytest.raises(SystemExit, match="--host-mem-gib -1"):
        main(ARGS + ["--host-mem-gib", "-1"])
