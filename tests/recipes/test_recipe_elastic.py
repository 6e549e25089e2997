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
    from engine.core.context import warn_shared_elastic_store

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with caplog.at_level(logging.WARNING, logger="acco_loco"):
        warn_shared_elastic_store()
    assert any("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    warn_shared_elastic_store()
    assert not caplog.records



def test_elastic_restart_agrees_over_the_host_group_not_the_nccl_default(tmp_path, monkeypatch):
    """Under accelerate on GPUs the default group is NCCL only: a CPU tensor all-reduced there
    fails (emulated here); the decision goes over the recipe's gloo group."""
    import torch.distributed as dist

    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-00000002\n")
    host = object()
    used = []

    def all_reduce(t, op=None, group=None):
        if group is None and t.device.type == "cpu":  # NCCL's default group
            raise RuntimeError("No backend type associated with device type cpu")
        used.append(group)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert elastic_restart(FinetuneConfig(output_dir=str(out)), out, host).resume
    assert used == [host]


def test_metrics_rows_are_gathered_in_batches_not_per_step(tmp_path, monkeypatch):
    """One gather of every rank's entries per ROWS_PER_GATHER steps (and at a checkpoint or the
    end of a piece), not one per step (that held the ranks in host lockstep); every step still gets
    its row, with the wall time of its commit."""
    from recipes import finetune

    gathers = []
    monkeypatch.setattr(finetune, "gather", lambda obj, group=None: gathers.append(len(obj)) or [obj, obj])

    class Acc:
        is_main_process = True

        def log(self, *a, **k):
            pass
    log = finetune.RunLog(FinetuneConfig(), Acc(), tmp_path / "metrics.jsonl", 0.0, 0)
    n = finetune.ROWS_PER_GATHER + 4
    elapsed = 0.0
    for step in range(1, n + 1):
        entry = {"step": step, "loss": 1.0, "lr": 0.1, "samples": 2, "time_s": 0.5, "grad_norm": 1.0,
                 "skipped": False, "wire_bytes": 8, "micro_batches": 1}
        elapsed = log.commit(entry, elapsed, flush=step == n)
    assert gathers == [finetune.ROWS_PER_GATHER, 4]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, n + 1)) and rows[-1]["elapsed_s"] == 0.5 * n
    assert rows[-1]["wire_bytes"] == [8, 8] and rows[-1]["samples_total"] == 2 * n
    assert all(a["wall"] <= b["wall"] for a, b in zip(rows, rows[1:]))
    assert log.commit_rest(elapsed) == elapsed and gathers == [finetune.ROWS_PER_GATHER, 4]
