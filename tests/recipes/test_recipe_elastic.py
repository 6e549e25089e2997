"""The fine-tune recipe under torchrun's elastic restarts: three one-worker agents on one c10d
rendezvous, the third killed with its worker mid-run; the survivors name the lost rank, restart,
resume from the last checkpoint at world 2 with the global batch kept, and finish. Real processes
(benchmarks/elastic_run.py's driver at a short length); plus the pieces the restart uses."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import pytest

from benchmarks import elastic_run
from recipes.finetune import FinetuneConfig, elastic_restart, work_lost

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="torchrun agents")


def test_a_killed_node_is_survived_at_world_2(tmp_path):
    args = argparse.Namespace(steps=24, checkpoint_every=6, kill_at_step=14, timeout_s=20.0, limit_s=240.0,
                              work=tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    out = elastic_run.run_killed(args, 0, logs)
    assert out["exit_codes"] == [0, 0], out
    assert out["lost_peer_named"]
    # both survivors resumed from the same checkpoint, at or before the kill, at 2 workers
    assert len(out["resumed_at"]) == 2 and len(set(out["resumed_at"])) == 1, out
    step, world = out["resumed_at"][0]
    assert world == 2 and step % 6 == 0 and 0 < step <= out["step_at_kill"], out
    assert out["steps"] == 24 and out["heldout_loss"] < 10
    assert len(out["work_lost"]) == 1 and f"after the checkpoint at step {step}" in out["work_lost"][0]
    rows = [json.loads(x) for x in (tmp_path / "killed-s0" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 25))  # the lines past the checkpoint were redone
    assert all(r["samples"] == 24 for r in train)  # the global batch is the run's, at 3 and at 2 workers
    assert {len(r["wire_bytes"]) for r in train} == {3, 2}


def test_work_lost_reads_the_rows_past_the_checkpoint():
    rows = [{"kind": "train", "step": s, "elapsed_s": 0.5 * s, "wall": 100.0 + s} for s in range(1, 9)]
    line = work_lost(rows + [{"kind": "eval", "step": 0}], 5)
    assert line.startswith("work lost: 3 step(s) after the checkpoint at step 5 (1.5 s of training")


def test_elastic_restart_resumes_only_from_the_second_attempt(tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    cfg = FinetuneConfig(output_dir=str(out))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not elastic_restart(cfg, out).resume  # no checkpoint yet: a fresh start
    (out / "checkpoints" / "latest").write_text("step-00000002\n")
    assert elastic_restart(cfg, out).resume
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not elastic_restart(cfg, out).resume  # the first attempt never resumes on its own


def test_the_shared_rendezvous_store_is_warned_about(monkeypatch, caplog):
    from engine.context import warn_shared_elastic_store

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with caplog.at_level(logging.WARNING, logger="acco_loco"):
        warn_shared_elastic_store()
    assert any("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    warn_shared_elastic_store()
    assert not caplog.records

