"""Save at step 10, resume, run to 20: identical to 20 straight steps, for every strategy."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

STRATEGIES = ("zero1", "dpu", "acco")


def _cfg(strategy, steps, **kw):
    return EngineConfig(strategy=strategy, lr=1e-2, micro_batches=2, accumulation="fixed",
                        max_steps=steps, align=8, weight_decay=0.01, **kw)


def straight_then_resumed(rank: int, world: int, strategy: str, root: str, first_kw: dict | None = None,
                          **kw):
    """``kw``: settings of the straight run and the resumed one; ``first_kw``: the first half's (default: kw)."""
    stream = worker_stream(rank, 200)
    straight = Engine(tiny_model(0), _cfg(strategy, 20, **kw), mse_loss)
    h_straight = straight.fit(stream)
    straight.close()

    first = Engine(tiny_model(0), _cfg(strategy, 10, **(kw if first_kw is None else first_kw)), mse_loss)
    h_first = first.fit(stream)
    first.save(f"{root}/ckpt")
    first.close()

    model = tiny_model(seed=123)  # different init: everything must come from the checkpoint
    resumed = Engine.load(f"{root}/ckpt", model, _cfg(strategy, 20, **kw), mse_loss)
    assert resumed.step == 10
    h_second = resumed.fit(itertools.islice(stream, resumed.consumed, None))
    resumed.close()
    return {"straight": flat_params(straight.model), "resumed": flat_params(model),
            "losses_straight": [h["loss"] for h in h_straight],
            "losses_resumed": [h["loss"] for h in h_first + h_second],
            "steps": [h["step"] for h in h_second]}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_world1_is_bit_exact(strategy, tmp_path):
    out = straight_then_resumed(0, 1, strategy, str(tmp_path))
    assert out["steps"] == list(range(11, 21))
    assert torch.equal(out["straight"], out["resumed"])
    assert out["losses_straight"] == out["losses_resumed"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_piece_scratch_resumes_bit_exact_from_a_whole_spare_checkpoint(strategy, tmp_path):
    """step_copy is no part of the trajectory: a run with the piece-sized scratch (3 pieces), resumed
    from the checkpoint of a run with the whole spare, equals it straight."""
    out = straight_then_resumed(0, 1, strategy, str(tmp_path), first_kw={"step_copy": "whole", "comm_chunks": 3},
                                step_copy="piece", comm_chunks=3)
    assert out["steps"] == list(range(11, 21))
    assert torch.equal(out["straight"], out["resumed"])
    assert out["losses_straight"] == out["losses_resumed"]


def _every_strategy(rank, world, root):
    return {s: straight_then_resumed(rank, world, s, f"{root}/{s}") for s in STRATEGIES}


def test_resume_world2_all_strategies(tmp_path):
    for per_rank in spawn(_every_strategy, 2, str(tmp_path)):
        for strategy, out in per_rank.items():
            assert out["steps"] == list(range(11, 21))
            assert torch.equal(out["straight"], out["resumed"]), strategy
            assert out["losses_straight"] == out["losses_resumed"], strategy


def test_checkpoint_layout_and_periodic_latest(tmp_path):
    cfg = _cfg("acco", 6, checkpoint_dir=str(tmp_path / "run"), checkpoint_every=2)
    engine = Engine(tiny_model(0), cfg, mse_loss)
    engine.fit(worker_stream(0, 100))
    engine.close()
    root = tmp_path / "run"
    assert (root / "latest").read_text().strip() == "step-00000006"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step-00000002", "step-00000004", "step-00000006"]
    files = sorted(p.name for p in (root / "step-00000004").iterdir())
    assert files == ["engine.json", "model.safetensors", "rank00000-of-00001.safetensors"]
    assert json.loads((root / "step-00000004" / "engine.json").read_text())["step"] == 4
    again = Engine.load(str(root), tiny_model(5), None, mse_loss)  # the root resolves to latest
    assert again.step == 6 and again.cfg.strategy == "acco"
    again.close()


def test_corrupt_checkpoint_says_so(tmp_path):
    engine = Engine(tiny_model(0), _cfg("zero1", 2), mse_loss)
    engine.fit(worker_stream(0, 10))
    engine.save(str(tmp_path / "c"))
    engine.close()
    rank_file = tmp_path / "c" / "rank00000-of-00001.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt"):
        Engine.load(str(tmp_path / "c"), tiny_model(0), None, mse_loss)
    with pytest.raises(FileNotFoundError, match="engine.json"):
        Engine.load(str(tmp_path / "nothing"), tiny_model(0), None, mse_loss)


def save_two(rank, world, root):
    e = Engine(tiny_model(0), _cfg("acco", 2), mse_loss)
    e.fit(worker_stream(rank, 20))
    e.save(root)
    e.close()


def test_resume_at_other_world_size_is_logged_and_other_config_refused(tmp_path, caplog):
    spawn(save_two, 2, str(tmp_path / "w2"))
    with caplog.at_level("WARNING", logger="acco_loco"):  # re-cut (tests/engine/test_reshard.py)
        one = Engine.load(str(tmp_path / "w2"), tiny_model(0), None, mse_loss)
    assert one.step == 2 and one.world_size == 1
    one.close()
    assert any("written by 2 workers, this run has 1" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="another model|does not match this model"):
        Engine.load(str(tmp_path / "w2"), torch.nn.Linear(6, 3), None, mse_loss)
    with pytest.raises(ValueError, match="strategy='acco' there, 'zero1' here"):
        Engine.load(str(tmp_path / "w2"), tiny_model(0), _cfg("zero1", 4), mse_loss)
    assert not Path(str(tmp_path / "w2") + ".tmp").exists()
