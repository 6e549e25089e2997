"""Smoke test of recipes/benchmark.py (through benchmarks/runner.py, worker.py, report.py and
plots.py): a small model (2 x 128, big enough that payload, not per-packet headers, dominates the
tx counters), 2 workers on 1 Gbit/s links, two modes under the matched-batch protocol (8 samples
per step: DDP at micro-batch 4, acco at micro-batch 2 over its 2 rounds).

Needs root (the testbed builds network namespaces); skipped with the testbed's reason otherwise.
Checks the exit status, the JSON fields, that both modes trained on the same samples per step,
that the wire bytes each mode accounts for agree with the interfaces' tx_bytes within 10%, and
that both PNGs are written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.testbed import requires_root_reason

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "recipes", "benchmark.py")

_reason = requires_root_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

FIELDS = (
    "mode", "lr", "step_time_median_s", "samples_per_s", "global_micro_batches_per_step",
    "wire_bytes_per_step_engine", "wire_bytes_per_step_tx", "tx_over_engine", "evals",
    "final_heldout_loss", "compute_only_samples_per_s", "throughput_efficiency", "target_loss",
    "time_to_target_s", "time_to_target_min_s", "time_to_target_max_s", "overlap_efficiency",
    "samples_per_step", "micro_batch", "batch", "loss_vs_ref_pct", "loss_vs_ref_pct_by_samples",
)


@pytest.mark.timeout(430)
def test_benchmark_smoke(tmp_path):
    out_json, plot, timeline = tmp_path / "b.json", tmp_path / "loss.png", tmp_path / "timeline.png"
    argv = [sys.executable, SCRIPT, "--workers", "2", "--rate", "1gbit",
            "--modes", "torch-ddp,zero1,acco+loco4", "--seeds", "1", "--samples", "64", "--global-batch", "8",
            "--no-lr-sweep", "--micro-batch", "4",
            "--seq-len", "32", "--n-layer", "2", "--n-embd", "128", "--n-head", "4",
            "--eval-points", "2", "--eval-batches", "2", "--compute-micro-batches", "1", "--no-compute-at-end",
            "--prefix", f"bs{os.getpid() % 100000}",
            "--json", str(out_json), "--plot", str(plot), "--timeline", str(timeline)]
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=420, cwd=REPO)
    assert cp.returncode == 0, f"exit {cp.returncode}\nstdout:\n{cp.stdout[-3000:]}\nstderr:\n{cp.stderr[-5000:]}"
    assert "| torch-ddp | 0.001 | 4 x acc 1 |" in cp.stdout
    assert "| acco+loco4 | 0.001 | 2 x 4/step (2 rounds) |" in cp.stdout

    doc = json.loads(out_json.read_text())
    assert doc["complete"] is True
    modes = {o["mode"]: o for o in doc["modes"]}
    assert set(modes) == {"torch-ddp", "zero1", "acco+loco4"}
    assert sorted({c["micro_batch"] for c in doc["compute_only"]}) == [2, 4]
    for name, o in modes.items():
        missing = [f for f in FIELDS if f not in o]
        assert not missing, f"{name} lacks {missing}"
        assert o["samples"] == 64 and o["steps"] == 8 and o["samples_per_step"] == 8
        assert o["samples_per_s"] > 0 and o["step_time_median_s"] > 0 and o["overlap_efficiency"] > 0
        assert [e["samples"] for e in o["evals"][0]] == [32, 64]
        assert o["wire_bytes_per_step_engine"] > 0 and o["wire_bytes_per_step_tx"] > 0
        # every worker's interface counter against what the mode accounts for, same window
        for ratio in o["runs"][0]["tx_over_engine_per_rank"]:
            assert abs(ratio - 1) <= 0.10, f"{name}: tx_bytes / accounted = {ratio:.3f}"
        assert all(e["loss"] is not None for e in o["evals"][0]), o["evals"]
        assert 0 < o["throughput_efficiency"]
    # the reference reaches its own final loss at its last eval point
    ref = modes["torch-ddp"]
    assert ref["target_loss"] == pytest.approx(ref["final_heldout_loss"]) and ref["loss_vs_ref_pct"] == 0
    assert modes["acco+loco4"]["loss_vs_ref_samples"] == 64 and modes["acco+loco4"]["micro_batch"] == 2
    assert ref["time_to_target_s"] == pytest.approx(ref["evals"][0][-1]["time_s"])
    # the dealt data: zero1 reads DDP's windows in every step (DDP at accumulation 1 and micro-batch
    # 4, zero1 at 2 micro-batches per step), so the same AdamW steps give DDP's losses
    for mine, ddp in zip(modes["zero1"]["evals"][0], ref["evals"][0]):
        assert mine["loss"] == pytest.approx(ddp["loss"], rel=1e-5)
    # 4-bit gradients + int8 param deltas, two rounds per step, still send less than fp32 DDP
    assert modes["acco+loco4"]["wire_bytes_per_step_engine"] < ref["wire_bytes_per_step_engine"]

    for png in (plot, timeline):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.timeout(310)
def test_benchmark_smoke_local_steps(tmp_path):
    """A local-step mode beside DDP: K x the budget, one inner step per DDP step's samples,
    evaluated at theta_sync after each outer round (every 15 inner steps, and the last one)."""
    out_json = tmp_path / "b.json"
    argv = [sys.executable, SCRIPT, "--workers", "2", "--rate", "1gbit",
            "--modes", "torch-ddp,sparseloco-h15,sparseloco-h15+overlap", "--seeds", "1", "--samples", "128",
            "--global-batch", "8", "--local-samples-factor", "2", "--no-lr-sweep", "--micro-batch", "4",
            "--seq-len", "32", "--n-layer", "2", "--n-embd", "128", "--n-head", "4",
            "--eval-points", "2", "--eval-batches", "2", "--compute-micro-batches", "1", "--no-compute-at-end",
            "--prefix", f"bl{os.getpid() % 100000}", "--json", str(out_json)]
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert cp.returncode == 0, f"exit {cp.returncode}\nstdout:\n{cp.stdout[-3000:]}\nstderr:\n{cp.stderr[-5000:]}"
    modes = {o["mode"]: o for o in json.loads(out_json.read_text())["modes"]}
    ref = modes["torch-ddp"]
    assert ref["samples"] == 128 and ref["steps"] == 16
    for name in ("sparseloco-h15", "sparseloco-h15+overlap"):
        o = modes[name]
        assert o["local_steps"] and o["batch"] == "4 x 2/step"
        # twice DDP's 16 steps, rounded up to whole outer periods of 15: 45 inner steps of DDP's
        # 8 samples, on a schedule over 45 steps
        assert o["samples"] == 360 and o["steps"] == 45 and o["samples_per_step"] == 8
        assert o["lr_schedule"]["total_steps"] == 45
        # theta_sync after each outer round (inner steps 15, 30, 45); overlapped, a round's result
        # is merged at the end of the next period: round 2's with the last round, which is waited for
        synced = [120, 360] if name.endswith("+overlap") else [120, 240, 360]
        assert [e["samples"] for e in o["evals"][0]] == synced
        assert all(e["loss"] is not None for e in o["evals"][0])
        assert o["loss_vs_ref_samples"] == 120  # the last point both reached
        # 2% top-k at 2-bit values every 15 steps: far below fp32 DDP's bytes per step
        assert 0 < o["wire_bytes_per_step_engine"] < ref["wire_bytes_per_step_engine"] / 100
        assert o["overlap_efficiency"] > 0
        assert f"{name} (360 samples):" in cp.stdout
    assert "without overlap" in cp.stdout


@pytest.mark.timeout(430)
def test_benchmark_smoke_nodes(tmp_path):
    """2 nodes x 2 ranks (--nodes 2 --ranks-per-node 2): DDP and a compressed engine mode on one
    link per node; the node links' counters per step in the JSON, equal on both nodes (the
    exchanges are symmetric) and at the formula's bytes (benchmarks/node_bytes.py) within 3% for
    DDP's ring all-reduce; the compressed engine mode sends less through a node's link."""
    from benchmarks import node_bytes as nb
    from engine import EngineConfig

    # with an engine that has the two-level exchange: flat and two-level side by side
    two_level = "topology" in EngineConfig.field_names()
    acco = ["acco+loco4+int4params@flat", "acco+loco4+int4params@two_level"] if two_level else ["acco+loco4+int4params"]
    out_json = tmp_path / "b.json"
    argv = [sys.executable, SCRIPT, "--nodes", "2", "--ranks-per-node", "2", "--rate", "1gbit",
            "--modes", ",".join(["torch-ddp", *acco]), "--seeds", "1", "--steps", "3", "--global-batch", "16",
            "--no-lr-sweep", "--micro-batch", "4", "--seq-len", "32", "--n-layer", "2", "--n-embd", "128",
            "--n-head", "4", "--eval-points", "1", "--eval-batches", "1", "--compute-micro-batches", "1",
            "--no-compute-at-end", "--prefix", f"bn{os.getpid() % 100000}", "--json", str(out_json)]
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=420, cwd=REPO)
    assert cp.returncode == 0, f"exit {cp.returncode}\nstdout:\n{cp.stdout[-3000:]}\nstderr:\n{cp.stderr[-5000:]}"
    assert "2 nodes x 2 ranks" in cp.stdout and "Bytes through a node's link" in cp.stdout
    doc = json.loads(out_json.read_text())
    assert doc["config"]["nodes"] == 2 and doc["config"]["ranks_per_node"] == 2 and doc["config"]["workers"] == 4
    modes = {o["mode"]: o for o in doc["modes"]}
    ddp = modes["torch-ddp"]
    s = ddp["wire_bytes_per_step_engine"] / 1.5  # DDP accounts a ring's 2 (N - 1) / N S, N = 4
    for o in modes.values():
        assert (o["nodes"], o["ranks_per_node"], o["steps"]) == (2, 2, 3)
        a, b = o["node_link_bytes_per_step"]
        assert a == o["node0_link_bytes_per_step"] and abs(a - b) <= 0.02 * a
        assert o["node0_link_bytes_per_step_whole_run"] > a  # start-up broadcast and evaluation too
    assert 1.0 <= ddp["node0_link_bytes_per_step"] / (nb.node_link_bytes_over_s("torch-ddp fp32", 2, 2) * s) <= 1.03
    assert modes[acco[0]]["node0_link_bytes_per_step"] < 0.5 * ddp["node0_link_bytes_per_step"]
    if two_level:  # the node's sum crosses the link once: the formula's 0.57x flat, 0.18x DDP
        flat, two = (modes[m]["node0_link_bytes_per_step"] for m in acco)
        assert modes[acco[1]]["topology"] == "two_level" and two <= 0.65 * flat and two <= ddp["node0_link_bytes_per_step"] / 3
