"""End to end: recipes/finetune.py under `accelerate launch` with 2 CPU processes, tiny model.

6 steps, then --resume to 10 (metrics continue at 7), the saved model reloads, and a
different configuration in the same output dir is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.texts import text_folder

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "finetune.py"
CPU_2PROC = REPO / "recipes" / "accelerate" / "cpu_2proc.yaml"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo launch via torchrun")


def _launch_cmd() -> list[str]:
    exe = shutil.which("accelerate")
    base = [exe] if exe else [sys.executable, "-m", "accelerate.commands.launch"]
    if exe:
        base.append("launch")
    return base + ["--config_file", str(CPU_2PROC), "--main_process_port", str(_free_port())]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(_launch_cmd() + [str(RECIPE)] + args, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _train_steps(metrics: Path) -> list[int]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r["kind"] == "train"]


def test_recipe_two_processes_resume_and_refusals(tmp_path):
    data = text_folder(tmp_path / "text")
    out = tmp_path / "out"
    common = ["--model", "tiny-gpt2", "--dataset", str(data), "--seq-len", "64",
              "--micro-batch-size", "4", "--train-layers", "2", "--eval-batches", "4",
              "--checkpoint-every", "3", "--output-dir", str(out), "--timeout-s", "60"]

    r = _run(common + ["--max-steps", "6"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _train_steps(out / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if x["kind"] == "train"]
    assert all(len(x["micro_batches"]) == 2 and len(x["wire_bytes"]) == 2 for x in train)
    assert {x["tag"] for x in rows if x["kind"] == "eval"} == {"before", "after"}
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    assert (out / "loss.png").stat().st_size > 0
    assert json.loads((out / "config.json").read_text())["max_steps"] == 6

    r = _run(common + ["--max-steps", "10", "--resume"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed at step 6" in r.stdout + r.stderr
    assert _train_steps(out / "metrics.jsonl") == list(range(1, 11))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000010"

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert sum(p.numel() for p in model.parameters()) > 0

    # a different trajectory in the same output dir: refused, nothing overwritten
    r = _run(common + ["--max-steps", "12", "--resume", "--lr", "1e-3"])
    assert r.returncode != 0  # the recipe exits 2; torchrun reports a failed worker as 1
    assert "different configuration" in r.stderr and "lr=" in r.stderr
    # --resume where there is no checkpoint
    r = _run(common[:-4] + ["--output-dir", str(tmp_path / "empty"), "--resume", "--max-steps", "2"])
    assert r.returncode != 0 and "no checkpoint" in r.stderr
