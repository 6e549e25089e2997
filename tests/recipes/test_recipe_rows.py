"""recipes/finetune.py's training loop writes a metrics.jsonl train row as each step commits:
a crash during step 20 keeps the rows of steps 1..19 (in process, world size 1, a tiny model;
tests/recipes/test_recipe_metrics.py checks the rows of whole runs)."""

from __future__ import annotations

import json

import pytest

from engine import Engine, EngineConfig
from recipes import finetune
from tests.tiny import mse_loss, tiny_model, worker_stream

K, CRASH_STEP = 2, 20


class _Accelerator:
    """What RunLog reads of accelerate's Accelerator, for one process."""

    is_main_process, process_index, num_processes = True, 0, 1

    def log(self, values: dict, step: int) -> None:
        pass

    def print(self, *args) -> None:
        pass


class _Stream:
    def __init__(self, batches):
        self.batches = batches

    def iter_from(self, index: int):
        return iter(self.batches[index:])


def test_a_crash_keeps_the_rows_of_the_steps_before_it(tmp_path):
    calls = 0

    def crashing_loss(model, batch):
        nonlocal calls
        calls += 1
        if calls > (CRASH_STEP - 1) * K:  # the first micro-batch of step 20
            raise RuntimeError("the data loader broke")
        return mse_loss(model, batch)

    cfg = finetune.FinetuneConfig(max_steps=30, eval_every=0)
    engine = Engine(tiny_model(0), EngineConfig(strategy="zero1", micro_batches=K, accumulation="fixed",
                                                max_steps=30), crashing_loss)
    log = finetune.RunLog(cfg, _Accelerator(), tmp_path / "metrics.jsonl", 0.0, 0)
    with pytest.raises(RuntimeError, match="data loader broke"):
        finetune.train(cfg, engine, engine.model, _Stream(worker_stream(0, K * 40)), None, log, print)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, CRASH_STEP))
    assert [r["loss"] for r in rows] == [h["loss"] for h in engine.history]
    assert all(r["kind"] == "train" and r["micro_batches"] == [K] for r in rows)
