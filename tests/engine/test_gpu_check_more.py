"""benchmarks/gpu_check.py's parts for issue 45 (benchmarks/gpu_parts_replicas.py,
gpu_parts_loading.py, gpu_parts_model.py) run through the real machinery on CPU at tiny sizes:
the calls into the engine, the spawned pairs and the comparisons are right, so the GPU's minutes go
to measuring (the figures mean nothing here). The part limits are the GPU's, scaled for a loaded
CPU (--limit-scale)."""

from __future__ import annotations

import importlib
import json

import pytest

from benchmarks import gpu_check

NEW = ("replicas", "muon", "local_sharded", "offload", "slice_load", "real_model")


def test_each_part_is_a_function_of_its_module():
    for part in gpu_check.PARTS:
        assert callable(getattr(importlib.import_module(f"benchmarks.{part.module}"), part.name)), part


def _smoke(tmp_path, parts: list[str]) -> dict:
    out = tmp_path / "smoke.json"
    code = gpu_check.main(["--json", str(out), "--device", "cpu", "--small", "--limit-scale", "8",
                           "--budget-s", "3000", "--parts", *parts])
    got = json.loads(out.read_text())["parts"]
    assert code == 0, {k: v.get("error", v.get("ok")) for k, v in got.items()}
    return got


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_two_process_parts_run_on_cpu(tmp_path):
    got = _smoke(tmp_path, ["replicas", "muon", "local_sharded"])
    rows = got["replicas"]["strategies"]
    assert set(rows) == {"zero1", "dpu", "acco", "acco+loco4+int4params", "diloco", "sparseloco", "local_sgd",
                         "onebit_adam"}
    assert all(r["replicas_equal"] and r["moved"] and r["steps"] == 8 for r in rows.values()), rows
    assert got["replicas"]["segment_sums"]["segment_sums_same_bits"]
    assert all(r["rel_err_vs_float64"] < 1e-5 for r in got["muon"]["strategies"].values())
    for strategy, ranks in got["local_sharded"]["strategies"].items():
        for r in ranks:  # half the local values, the same losses as one process of the node's batches
            assert r["local_values"][1] * 2 == r["local_values"][0] and r["loss_max_abs_diff"] <= 1e-3, (strategy, r)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_state_and_model_parts_run_on_cpu(tmp_path):
    got = _smoke(tmp_path, ["offload", "slice_load", "real_model"])
    assert all(r["bit_identical"] for r in got["offload"]["modes"].values())  # on CPU the offloaded step is the same
    assert got["offload"]["copies"]["to_device_GBps"] > 0 and got["offload"]["host_step"]["torch_values_per_s"] > 0
    load = got["slice_load"]
    assert all(r["held_while_loading"] <= load["bound_bytes"] < load["model"]["model_bytes"] for r in load["ranks"])
    modes = got["real_model"]["modes"]["rank0"]
    assert set(modes) == {"zero1", "acco+loco4+int4params"}
    assert all(m["heldout_after"] < m["heldout_before"] and m["wire_bytes_per_round"] > 0 for m in modes.values())
    assert modes["zero1"]["rounds_per_step"] == 1 and modes["acco+loco4+int4params"]["rounds_per_step"] == 2
