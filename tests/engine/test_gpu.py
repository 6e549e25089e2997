"""CUDA stream path (skipped without a GPU): event ordering, no buffer reuse before a round is
done (freed buffers are poisoned with NaN), bf16 compute params with an fp32 master."""

from __future__ import annotations


import pytest
import torch

from engine import Engine, EngineConfig
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def cuda_stream(n):
    return [(x.cuda(), y.cuda()) for x, y in worker_stream(0, n)]


@pytest.mark.parametrize("strategy", ["zero1", "dpu", "acco"])
def test_cuda_streams_match_reference_with_poisoned_buffers(strategy):
    model = tiny_model(0).cuda()
    cfg = EngineConfig(strategy=strategy, lr=1e-2, micro_batches=2, accumulation="fixed", max_steps=20,
                       align=8, poison_freed_buffers=True, weight_decay=0.1)
    engine = Engine(model, cfg, mse_loss)
    assert engine.worker.stream is not None  # the comm side really runs on its own stream
    engine.fit(cuda_stream(200))
    engine.close()
    want = Reference(tiny_model(0), [worker_stream(0, 200)], 2, lr=1e-2, weight_decay=0.1).run(strategy, 20)
    got = flat_params(model).cpu()
    assert torch.isfinite(got).all()
    assert rel_err(got, want[-1]) < 1e-5


def test_adaptive_overlap_with_slow_comm_stream_keeps_order():
    """A round made slow on the GPU (a long kernel on the comm stream) must not be installed
    before it is done: the compute stream waits on its event, and results still match."""
    model = tiny_model(0).cuda()
    cfg = EngineConfig(strategy="acco", lr=1e-2, micro_batches=1, accumulation="grow", max_steps=6,
                       align=8, poison_freed_buffers=True)
    import engine.rounds as rounds

    real = rounds.run_round

    def slow_round(engine, req):
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(20):  # keeps the comm stream busy after the CPU side has returned
            a = a @ a / a.norm()
        return real(engine, req)

    import engine.engine as eng

    eng.run_round = slow_round
    try:
        engine = Engine(model, cfg, mse_loss)
        engine.fit(cuda_stream(2000))
        engine.close()
    finally:
        eng.run_round = real
    counts = [engine.round_counts]
    want = Reference(tiny_model(0), [worker_stream(0, 2000)], 1, lr=1e-2, round_counts=counts,
                     weight_decay=0.0).run("acco", 6)
    assert rel_err(flat_params(model).cpu(), want[-1]) < 1e-5


def test_bf16_compute_params_fp32_master():
    model = tiny_model(0).cuda()
    cfg = EngineConfig(strategy="acco", lr=1e-3, micro_batches=2, accumulation="fixed", max_steps=10,
                       align=8, compute_dtype="bfloat16")
    engine = Engine(model, cfg, lambda m, b: mse_loss(m, (b[0].bfloat16(), b[1].bfloat16())).float())
    engine.fit(cuda_stream(100))
    engine.close()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    master = engine.shard_state.master
    assert master.dtype == torch.float32
    n = engine.flat.numel
    # replicas hold the bf16 rounding of the exact fp32 master
    assert torch.equal(engine.flat.data[:n], master[:n].to(torch.bfloat16))
    assert not torch.equal(master[:n], master[:n].to(torch.bfloat16).float())
