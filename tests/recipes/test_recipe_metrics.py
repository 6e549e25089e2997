"""recipes/finetune.py at world size 1 (plain `python`, no launcher), tiny model: what it logs.

* --eval-every fits in pieces without touching the lr schedule's horizon (cosine stays cosine);
* elapsed_s is stamped per step and continues after --resume;
* --report-to tensorboard writes the same per-step numbers as metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acco_loco.schedule import lr_at
from tests.texts import text_folder

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "finetune.py"

pytestmark = pytest.mark.timeout(180)


def run_recipe(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # one process on its own, whatever launched pytest
    return subprocess.run([sys.executable, str(RECIPE)] + args, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def tiny_args(data: Path, out: Path) -> list[str]:
    # --max-round-overhead 0: a tiny-gpt2 micro-batch is so cheap that the engine's floor would
    # ask for dozens per round; these tests are about logging, not pacing
    return ["--model", "tiny-gpt2", "--dataset", str(data), "--seq-len", "32", "--micro-batch-size", "2",
            "--train-layers", "2", "--eval-batches", "2", "--max-round-overhead", "0",
            "--output-dir", str(out)]


def rows(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def cosine_run(tmp_path_factory):
    """6 steps, cosine, an evaluation every 2 steps, logged to tensorboard too."""
    tmp = tmp_path_factory.mktemp("cosine")
    out = tmp / "out"
    r = run_recipe(tiny_args(text_folder(tmp / "text"), out)
                   + ["--max-steps", "6", "--lr", "1e-3", "--lr-schedule", "cosine", "--eval-every", "2",
                      "--report-to", "tensorboard"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_eval_every_keeps_the_schedule_horizon(cosine_run):
    train = rows(cosine_run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    expected = [lr_at(r["step"] - 1, 1e-3, "cosine", total_steps=6) for r in train]
    assert [r["lr"] for r in train] == pytest.approx(expected, rel=1e-6)
    assert all(a["lr"] > b["lr"] for a, b in zip(train, train[1:]))  # no jump back at an evaluation
    assert [(r["tag"], r["step"]) for r in rows(cosine_run, "eval")] == \
        [("before", 0), ("eval", 2), ("eval", 4), ("after", 6)]


def test_tensorboard_holds_the_metrics(cosine_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(cosine_run.glob("tensorboard/**/events.out.tfevents.*"))
    assert files, f"no event file under {cosine_run}"
    scalars = {}
    for f in files:  # accelerate also writes an hparams-only event file
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    train, evals = rows(cosine_run, "train"), rows(cosine_run, "eval")
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/samples_total", "samples_total"),
                     ("train/elapsed_s", "elapsed_s"), ("train/grad_norm", "grad_norm")):
        assert [s for s, _ in scalars[tag]] == [r["step"] for r in train], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([r[key] for r in train], rel=1e-5), tag
    assert [v for _, v in scalars["eval/loss"]] == pytest.approx([r["eval_loss"] for r in evals], rel=1e-5)
    assert [v for _, v in scalars["eval/ppl"]] == pytest.approx([r["eval_ppl"] for r in evals], rel=1e-5)


def test_elapsed_is_per_step_and_continues_after_resume(tmp_path):
    data, out = text_folder(tmp_path / "text"), tmp_path / "out"
    r = run_recipe(tiny_args(data, out) + ["--max-steps", "4", "--checkpoint-every", "2"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    first = rows(out, "train")
    elapsed = [r["elapsed_s"] for r in first]
    assert all(b > a for a, b in zip(elapsed, elapsed[1:])), elapsed  # not one stamp per fit call
    # each stamp is the previous one plus that step's own time
    for a, b in zip(first, first[1:]):
        assert b["elapsed_s"] - a["elapsed_s"] == pytest.approx(b["time_s"], abs=1e-6)
    last_before = max(r["elapsed_s"] for r in rows(out, "train") + rows(out, "eval"))

    r = run_recipe(tiny_args(data, out) + ["--max-steps", "6", "--checkpoint-every", "2", "--resume"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    train = rows(out, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert train[:4] == first
    resumed = [r["elapsed_s"] for r in train[4:]]
    assert resumed[0] > last_before and resumed[1] > resumed[0]
    assert all(math.isfinite(x) for x in resumed)
