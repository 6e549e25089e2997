"""benchmarks/gpu_check.py, the first run on one GPU, checked without one: the machinery (each
part in its own process with a time limit, the JSON rewritten after every part, the whole within
its budget) with stand-in parts; the real parts' code paths on CPU at tiny sizes; and on a machine
without CUDA a clear exit 2 with nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_exits_with_a_clear_message(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr and "needs one NVIDIA GPU" in proc.stderr
    assert not out.exists()


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_each_part_in_its_own_process_with_a_limit_and_the_json_after_each(tmp_path):
    """A part that passes, one that hangs (killed at its limit, with the process it spawned), one
    that crashes without a result; a fourth reads the JSON as it stands: the first three are in it."""
    out, grandchild = tmp_path / "report.json", tmp_path / "grandchild.pid"
    write = "import json,sys; json.dump({d}, open(sys.argv[1], 'w'))"
    hang = ("import subprocess,sys,time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(grandchild)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    seen = f"import json,sys; r = json.load(open({str(out)!r})); json.dump({{'ok': True, 'seen': sorted(r['parts'])}}, open(sys.argv[1], 'w'))"
    steps = [("passes", 30, lambda res, lim: _py(write.format(d="{'ok': True, 'value': 3}")) + [str(res)]),
             ("hangs", 3, lambda res, lim: _py(hang) + [str(res)]),
             ("crashes", 30, lambda res, lim: _py("raise SystemExit(3)")),
             ("reads", 30, lambda res, lim: _py(seen) + [str(res)])]
    report: dict = {}
    t0 = time.monotonic()
    assert gpu_check.run_parts(steps, out, report, budget_s=120) is False
    assert time.monotonic() - t0 < 40
    got = json.loads(out.read_text())["parts"]
    assert got["passes"]["ok"] and got["passes"]["value"] == 3
    assert not got["hangs"]["ok"] and got["hangs"]["error"].startswith("timed out after 3 s")
    assert not got["crashes"]["ok"] and got["crashes"]["error"] == "exit status 3 without a result"
    assert got["reads"]["seen"] == ["crashes", "hangs", "passes"]  # written after each part
    pid = int(grandchild.read_text())
    with pytest.raises(ProcessLookupError):  # the hung part's own child was killed with it
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.2)


def test_the_budget_bounds_the_whole_run(tmp_path):
    out = tmp_path / "report.json"
    steps = [("slow", 30, lambda res, lim: _py("import time; time.sleep(30)")),
             ("later", 30, lambda res, lim: _py("pass"))]
    assert gpu_check.run_parts(steps, out, {}, budget_s=12) is False
    got = json.loads(out.read_text())["parts"]
    assert got["slow"]["error"].startswith("timed out after 12 s")
    assert got["later"]["error"] == "not run: the 12 s budget was spent"


def test_the_parts_fit_in_eight_minutes():
    assert gpu_check.BUDGET_S <= 8 * 60
    assert sum(p.limit_s for p in gpu_check.PARTS) <= gpu_check.BUDGET_S  # no part cut short by the others
    assert set(gpu_check.BY_NAME) == {"nccl_world1", "gloo_pair", "sync_debug", "codecs", "overlap", "memory",
                                      "model_sharding", "finetune", "gpu_tests", "replicas", "muon", "local_sharded",
                                      "offload", "slice_load", "real_model"}


def test_the_memory_formula_is_the_planners():
    from benchmarks.gpu_parts import MEMORY_MODES, formula_bytes_per_param
    from engine.planner.memory import memory_per_gpu
    from engine.planner.modes import Mode
    from engine.planner.shape import ModelShape
    from engine.planner.wire import Layout

    p = 1 << 20
    for name in MEMORY_MODES:
        want = memory_per_gpu(Mode(MEMORY_MODES[name]["strategy"], codec=MEMORY_MODES[name].get("codec", "none")),
                              ModelShape(p, 1, 1, 1), Layout(1)).total / p
        assert formula_bytes_per_param(name, p) == want > 16
    assert formula_bytes_per_param("acco", p) > formula_bytes_per_param("zero1", p)  # the kept half


def test_the_model_sharding_part_runs_at_world_1_on_cpu(tmp_path):
    """Run through the real machinery (its own process) on CPU: model_sharding='node' in one
    process (no launcher: the engine makes the one-rank group FSDP2 needs), zero1 and acco, the
    loss falling and FSDP2's unsharded blocks freed; the formula's figure is there (compared with
    memory_allocated on CUDA only)."""
    out = tmp_path / "smoke.json"
    assert gpu_check.main(["--json", str(out), "--device", "cpu", "--small", "--limit-scale", "6",
                           "--parts", "model_sharding"]) == 0
    got = json.loads(out.read_text())["parts"]["model_sharding"]
    assert got["ok"] and got["available"] and got["world"] == 1, got
    for name, row in got["strategies"].items():
        assert row["steps"] == 4 and row["losses"][-1] < row["losses"][0], (name, row)
        assert row["fsdp_unsharded_bytes"] == 0 and row["formula_bytes_per_param"] > 0, (name, row)


@pytest.mark.slow
def test_its_code_paths_run_on_cpu(tmp_path):
    """A smoke run of every part that can run on CPU, each in its own process, at tiny sizes: the
    script's calls into the engine, the codecs and the planner are right, so a GPU day is not
    lost to a typo (the figures mean nothing; memory is not measured on CPU)."""
    out = tmp_path / "smoke.json"
    parts = ["nccl_world1", "gloo_pair", "sync_debug", "codecs", "overlap", "memory"]
    assert gpu_check.main(["--json", str(out), "--device", "cpu", "--small", "--repeats", "2", "--no-compile",
                           "--budget-s", "1200", "--limit-scale", "4", "--parts", *parts]) == 0, out.read_text()
    got = json.loads(out.read_text())["parts"]
    assert got["nccl_world1"] == {"ok": True, "skipped": "needs CUDA"}
    assert got["gloo_pair"]["replicas_equal"] and len(got["gloo_pair"]["losses"]) == 4
    assert all(r["steps"] == 6 for r in got["sync_debug"]["strategies"].values())
    assert set(got["codecs"]["codecs"]) == {"copy", "int8", "int4", "int2", "sign1", "topk"}
    assert all(r["bits_equal_cpu"] for k, r in got["codecs"]["codecs"].items() if k != "copy")
    ov = got["overlap"]
    assert ov["acco"]["samples_per_step"] == ov["zero1"]["samples_per_step"] and ov["micro_batches"] == {"acco": 2, "zero1": 4}
    assert all(r["steps"] == 4 and r["formula"] > 16 for r in got["memory"]["strategies"].values())


def test_the_gpu_tests_it_runs_are_collected():
    """The GPU-marked tests import and collect on CPU (the old ones patched functions gone long ago)."""
    from benchmarks.gpu_parts import GPU_TEST_FILES

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p",
                           "no:cacheprovider", *GPU_TEST_FILES], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # test_gpu.py: 9 of 11; test_compiled_codecs.py: the 5 CUDA cases of 10
    assert "14/21 tests collected" in proc.stdout, proc.stdout
