"""Bad input gets a clear error that says what to do; NaN/Inf never reaches the master."""

from __future__ import annotations

import math

import pytest
import torch

from engine import Engine, EngineConfig, NonFiniteGradientError
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "ddp"}, "unknown strategy 'ddp'"),
    ({"lr": 0}, "lr must be a finite number > 0"),
    ({"lr": -1e-3}, "lr must be a finite number > 0"),
    ({"lr": float("inf")}, "lr must be a finite number > 0, got inf"),
    ({"micro_batches": 0}, "micro_batches must be a positive integer"),
    ({"micro_batches": 1.5}, "micro_batches must be a positive integer"),
    ({"max_steps": 0}, "max_steps must be a positive integer"),
    ({"accumulation": "sometimes"}, "unknown accumulation"),
    ({"optimizer": "lamb"}, "unknown optimizer"),
    ({"nan_policy": "ignore"}, "unknown nan_policy"),
    ({"lr_schedule": "step"}, "unknown lr_schedule"),
    ({"micro_batches": 4, "max_micro_batches": 2}, "max_micro_batches"),
    ({"checkpoint_every": 5}, "checkpoint_dir"),
    ({"timeout_s": 2, "heartbeat_s": 1}, "heartbeat_s"),
    ({"betas": (0.9, 1.0)}, "betas"),
])
def test_bad_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_model_and_types():
    frozen = tiny_model()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        Engine(frozen, EngineConfig())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        Engine("model", EngineConfig())
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(tiny_model(), {"lr": 1e-3})
    engine = Engine(tiny_model(), EngineConfig(max_steps=1))  # default loss needs dict batches
    with pytest.raises(TypeError, match="need a loss_fn"):
        engine.fit(worker_stream(0, 4))
    engine.close()
    engine = Engine(tiny_model(), EngineConfig(max_steps=1), lambda m, b: m(b[0]))
    with pytest.raises(TypeError, match="scalar tensor"):
        engine.fit(worker_stream(0, 4))
    engine.close()


def test_zero_grad_set_to_none_is_caught():
    model = tiny_model()
    def loss_fn(m, b):
        m.zero_grad(set_to_none=True)
        return mse_loss(m, b)
    engine = Engine(model, EngineConfig(max_steps=2, strategy="zero1"), loss_fn)
    with pytest.raises(RuntimeError, match="replaced or set to None"):
        engine.fit(worker_stream(0, 8))
    engine.close()


def nan_at(batch_index: int):
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        loss = mse_loss(model, batch)
        return loss * float("nan") if calls[0] == batch_index else loss
    return loss_fn


@pytest.mark.parametrize("strategy", ["zero1", "dpu", "acco"])
def test_nan_gradient_skip_keeps_master_finite(strategy):
    model = tiny_model()
    engine = Engine(model, EngineConfig(strategy=strategy, max_steps=8, micro_batches=2, accumulation="fixed",
                                        lr=1e-2, align=8), nan_at(5))
    history = engine.fit(worker_stream(0, 100))
    engine.close()
    assert len(history) == 8
    skipped = [h["step"] for h in history if h["skipped"]]
    assert len(skipped) == 1
    assert math.isnan(history[skipped[0] - 1]["grad_norm"])
    assert torch.isfinite(flat_params(model)).all()
    assert torch.isfinite(engine.shard_state.master).all() and torch.isfinite(engine.shard_state.exp_avg_sq).all()
    assert engine.shard_state.step == 7  # Adam's step counts applied updates only


def test_nan_gradient_stop_names_rank():
    engine = Engine(tiny_model(), EngineConfig(strategy="acco", max_steps=8, nan_policy="stop", align=8), nan_at(3))
    with pytest.raises(NonFiniteGradientError, match=r"rank\(s\) \[0\].*nan_policy='skip'"):
        engine.fit(worker_stream(0, 100))


def test_data_running_out_stops_and_keeps_pending():
    engine = Engine(tiny_model(), EngineConfig(strategy="acco", max_steps=50, micro_batches=2,
                                               accumulation="fixed", align=8), mse_loss)
    stream = worker_stream(0, 23)
    history = engine.fit(stream[:11])  # 11 micro-batches: 5 full rounds + 1 partial
    assert len(history) >= 2 and engine.consumed == 11
    more = engine.fit(stream[11:])  # nothing lost: training goes on from there
    assert more and more[0]["step"] == history[-1]["step"] + 1
    engine.close()


def test_clipping_and_schedule_are_applied():
    engine = Engine(tiny_model(), EngineConfig(strategy="zero1", max_steps=6, lr=1.0, max_grad_norm=1e-3,
                                               optimizer="sgd", momentum=0.0, lr_schedule="cosine",
                                               warmup_steps=2, align=8), mse_loss)
    before = flat_params(engine.model)
    history = engine.fit(worker_stream(0, 20))
    engine.close()
    lrs = [h["lr"] for h in history]
    assert lrs[0] == pytest.approx(1 / 3) and lrs[1] == pytest.approx(2 / 3) and lrs[2] == pytest.approx(1.0)
    assert lrs[-1] < lrs[2]
    assert all(h["grad_norm"] > 1e-3 for h in history)  # so clipping was active
    # plain SGD: every step moves the params by lr_t * (clipped norm) at most
    moved = float((flat_params(engine.model) - before).norm())
    assert 0.5 * 1e-3 * lrs[0] < moved <= 1e-3 * sum(lrs) * (1 + 1e-5)


def test_progress_bar_reaches_the_last_step(capsys):
    engine = Engine(tiny_model(), EngineConfig(max_steps=3, align=8, progress=True, accumulation="fixed"), mse_loss)
    engine.fit(worker_stream(0, 40))
    engine.close()
    assert "3/3" in capsys.readouterr().err  # it used to stop at 2/3
