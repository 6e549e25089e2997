"""Every rank trains the same thing: a rank built with another model or config is named at start.

Before the check, rank 1 with a deeper model made gloo abort the process (``gloo::EnforceNotMet ...
Received data size doesn't match expected size``) in the first broadcast while rank 0 waited."""

from __future__ import annotations

import time

import torch

from engine import Engine, EngineConfig
from engine.parallel.agreement import describe, first_difference
from engine.parallel.local_group import spawn, spawn_collect
from tests.tiny import HIDDEN, IN, OUT, mse_loss, tiny_model, worker_stream

STRATEGIES = ("zero1", "acco", "diloco")
TIMEOUT_S = 20.0


def deeper_model(seed: int = 0) -> torch.nn.Module:
    """tiny_model with one more hidden layer: another layer count, as a wrong flag would give."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _cfg(strategy: str, **kw) -> EngineConfig:
    extra = {"inner_steps": 2, "micro_batches": 1} if strategy == "diloco" else {"micro_batches": 2}
    base = dict(strategy=strategy, lr=1e-2, accumulation="fixed", max_steps=2, align=8, timeout_s=TIMEOUT_S,
                heartbeat_s=0.5)
    return EngineConfig(**{**base, **extra, **kw})


def _attempt(build) -> dict:
    start = time.monotonic()
    try:
        engine = build()
    except ValueError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    engine.close()
    return {"error": None, "elapsed": time.monotonic() - start}


def every_case(rank: int, world: int) -> dict:
    out = {}
    for s in STRATEGIES:
        model = deeper_model() if rank == 1 else tiny_model(0)
        out[s, "model"] = _attempt(lambda: Engine(model, _cfg(s), mse_loss))
        cfg = _cfg(s, lr=2e-2) if rank == 1 else _cfg(s)
        out[s, "config"] = _attempt(lambda: Engine(tiny_model(0), cfg, mse_loss))
        # per-rank settings (timeouts, where checkpoints go) may differ; matching ranks train as before
        engine = Engine(tiny_model(0), _cfg(s, timeout_s=TIMEOUT_S + rank), mse_loss)
        out[s, "losses"] = [h["loss"] for h in engine.fit(worker_stream(rank, 20))]
        engine.close()
    return out


def test_mismatched_model_or_config_raises_on_every_rank():
    per_rank = spawn(every_case, 2, timeout=240)
    for rank, out in enumerate(per_rank):
        for s in STRATEGIES:
            model, cfg = out[s, "model"], out[s, "config"]
            assert model["error"] is not None and cfg["error"] is not None, (rank, s)
            assert model["elapsed"] < 30 and cfg["elapsed"] < 30, (rank, s)
            # the same message on both ranks: the rank, the first difference, what to do
            assert "rank 1 was started with another model or configuration than rank 0" in model["error"]
            assert "parameter 2.weight: shape (3, 16)" in model["error"], model["error"]
            assert "shape (16, 16)" in model["error"] and "restart all ranks" in model["error"]
            assert "config.optim.lr: 0.01 on rank 0, 0.02 on rank 1" in cfg["error"], cfg["error"]
            assert len(out[s, "losses"]) == 2 and all(torch.isfinite(torch.tensor(out[s, "losses"])))
    for s in STRATEGIES:
        assert per_rank[0][s, "model"]["error"] == per_rank[1][s, "model"]["error"]


def uncaught_mismatch(rank: int, world: int) -> None:
    cfg = _cfg("zero1", codec="loco4", group_size=8) if rank == 1 else _cfg("zero1")
    Engine(tiny_model(0), cfg, mse_loss)


def test_mismatch_ends_every_process_with_the_message():
    """As a user's script sees it: both processes exit non-zero with the named difference."""
    out = spawn_collect(uncaught_mismatch, 2, timeout=60)
    for r in range(2):
        assert out[r]["exitcode"] not in (0, None), out[r]
        assert "config.comm.codec: 'none' on rank 0, 'loco4' on rank 1" in out[r]["out"], out[r]["out"]
        assert "gloo::EnforceNotMet" not in out[r]["out"]


def test_description_covers_layout_and_config_not_per_rank_settings():
    a = describe(tiny_model(0), _cfg("acco"))
    assert a == describe(tiny_model(5), _cfg("acco", timeout_s=99.0, checkpoint_dir="/elsewhere"))
    frozen = tiny_model(0)
    frozen[0].bias.requires_grad_(False)
    assert first_difference(a, describe(frozen, _cfg("acco")))[0] == "parameter 0.bias"
    assert first_difference(a, describe(tiny_model(0, torch.float64), _cfg("acco")))[0] == "parameter 0.weight"
    assert first_difference(a, describe(tiny_model(0), _cfg("acco", global_micro_batches=4, micro_batches=1)))[0] == \
        "config.accumulate.global_micro_batches"
    assert first_difference(a, describe(tiny_model(0), _cfg("acco", checkpoint_every=5, checkpoint_dir="/x")))[0] == \
        "config.runtime.checkpoint_every"
