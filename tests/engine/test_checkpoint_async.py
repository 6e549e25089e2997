"""checkpoint_async: periodic checkpoints written on a thread from a copy of the state. In a gloo
group of 2 (acco + loco4, and diloco): the same trajectory and the same files as synchronous
saves (every tensor equal), every checkpoint finished by the next save or close with `latest`
on the newest, and a resume from it bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from engine.checkpoint.files import read as _read
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

STEPS, K, EVERY = 9, 2, 3
KW = {"acco": {"codec": "loco4", "param_codec": "int8", "group_size": 8}, "diloco": {"inner_steps": 3}}


def _run(rank: int, world: int, root: str, strategy: str, background: bool) -> dict:
    cfg = EngineConfig(strategy=strategy, micro_batches=K, max_steps=STEPS, align=8, lr=1e-2,
                       checkpoint_dir=root, checkpoint_every=EVERY, checkpoint_async=background, **KW[strategy])
    engine = Engine(tiny_model(0), cfg, mse_loss)
    data = worker_stream(rank, 2 * K * (STEPS + 1))
    engine.fit(data)
    unfinished = sorted(p.name for p in Path(root).glob("*.tmp"))  # the last one, before close
    engine.close()
    resumed = Engine.load(f"{root}/step-{EVERY * 2:08d}", tiny_model(0), cfg, mse_loss)
    resumed.fit(data[resumed.consumed:])
    out = {"params": flat_params(engine.model), "resumed": flat_params(resumed.model),
           "unfinished_before_close": unfinished}
    resumed.close()
    return out


@pytest.mark.parametrize("strategy", ["acco", "diloco"])
def test_background_saves_equal_synchronous_ones(tmp_path, strategy):
    sync = spawn(_run, 2, str(tmp_path / "sync"), strategy, False)
    back = spawn(_run, 2, str(tmp_path / "async"), strategy, True)
    for r in range(2):
        assert torch.equal(sync[r]["params"], back[r]["params"])  # saving in the background changes nothing
        assert torch.equal(back[r]["resumed"], back[r]["params"])  # resume from a background save: bit-exact
    assert sync[0]["unfinished_before_close"] == []
    assert back[0]["unfinished_before_close"] == [f"step-{STEPS:08d}.tmp"]  # finished only at close
    steps = [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
    for name in steps:
        a, b = tmp_path / "sync" / name, tmp_path / "async" / name
        for f in sorted(p.name for p in a.glob("*.safetensors")):
            ta, _ = _read(a / f, True)
            tb, _ = _read(b / f, True)
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), (name, f)
    assert (tmp_path / "async" / "latest").read_text().strip() == steps[-1]
