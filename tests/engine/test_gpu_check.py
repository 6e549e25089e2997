"""benchmarks/gpu_check.py, the GPU acceptance run: on a machine without CUDA it says so and
exits 2 without writing results; its memory formulas are README.md's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_exits_with_a_clear_message(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr and "needs one NVIDIA GPU" in proc.stderr
    assert not out.exists()


def test_memory_formulas_are_the_readmes():
    from benchmarks.gpu_check import formula_bytes_per_param

    assert formula_bytes_per_param("zero1", 1) == 28 and formula_bytes_per_param("zero1", 4) == 16 + 3  # 16 + 12/N
    assert formula_bytes_per_param("sparseloco", 8) == 40  # README: 40 bytes per parameter and worker
    assert formula_bytes_per_param("acco", 2) == 16 + 10
    with pytest.raises(ValueError):
        formula_bytes_per_param("onebit_adam")


def test_the_gpu_tests_it_runs_are_collected():
    """The GPU-marked tests import and collect on CPU (the old ones patched functions gone long ago)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p",
                           "no:cacheprovider", "tests/engine/test_gpu.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "9/10 tests collected" in proc.stdout, proc.stdout


def test_its_code_paths_run_on_cpu(tmp_path):
    """A smoke run of every part but the GPU tests on CPU at tiny sizes: the script's calls into the
    engine, the codecs and the recipe are right, so a GPU day is not lost to a typo (the figures
    mean nothing; memory is not measured on CPU)."""
    import json

    from benchmarks import gpu_check

    out = tmp_path / "smoke.json"
    assert gpu_check.main(["--json", str(out), "--device", "cpu", "--small", "--repeats", "2", "--no-compile",
                           "--parts", "overlap", "codecs", "memory", "finetune"]) == 0
    got = json.loads(out.read_text())
    assert got["overlap"]["ok"] and got["overlap"]["zero1"]["steps"] == 5 and got["overlap"]["acco"]["steps"] == 5
    assert set(got["codecs"]["codecs"]) == {"copy", "int8", "int4", "int2", "sign1", "topk"}
    assert all(r["encode_gb_s"] > 0 and r["decode_gb_s"] > 0 for k, r in got["codecs"]["codecs"].items() if k != "copy")
    assert all(r["steps"] == 4 for r in got["memory"]["strategies"].values())
    assert got["finetune"]["steps"] == 5 and len(got["finetune"]["losses"]) == 5
