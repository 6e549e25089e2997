"""CUDA stream path: event ordering, no buffer reuse before a round is done (freed buffers are
poisoned with NaN), bf16 compute params with an fp32 master, CPU batches placed by the engine,
CUDA-event clocks, and a world-2 NCCL group where the machine has two GPUs.

The CUDA tests skip without a GPU (benchmarks/gpu_check.py runs them on one, the hot loop under
``torch.cuda.set_sync_debug_mode("error")``). What each of them hooks into is checked on CPU too:
the slow-round test's patch point (``engine.strategy.run_round``) runs on CPU with a slow round
made of a sleep, so a refactor that moves it fails here, not on the first GPU day (issue 23:
the old patch targets ``engine.rounds.run_round`` had been gone for months)."""

from __future__ import annotations

import time

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL at world 2 needs two GPUs")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


@pytest.fixture(autouse=True)
def no_tf32():
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def cuda_stream(n):
    return [(x.cuda(), y.cuda()) for x, y in worker_stream(0, n)]


def sync_debug_error():
    """Any synchronising CUDA call in the block raises (the hot loop's promise: no host syncs)."""
    class Mode:
        def __enter__(self):
            self.old = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode(self.old)
    return Mode()


@pytest.mark.gpu
@CUDA
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


@pytest.mark.gpu
@CUDA
def test_cpu_batches_are_placed_by_the_engine_and_match_device_batches():
    """The user hands CPU micro-batches (as the recipe does); the engine copies them from pinned
    memory on its copy stream: the same parameters, bit for bit, as with batches made on the GPU."""
    cfg = EngineConfig(strategy="acco", lr=1e-2, micro_batches=2, accumulation="fixed", max_steps=10, align=8)
    a = Engine(tiny_model(0).cuda(), cfg, mse_loss)
    assert a.placement.stream is not None
    a.fit(worker_stream(0, 100))
    a.close()
    b = Engine(tiny_model(0).cuda(), cfg, mse_loss)
    b.fit(cuda_stream(100))
    b.close()
    assert torch.equal(a.flat.data, b.flat.data)


def slow_run_round(engine, device: str):
    """Wrap the engine's round so that it stays busy after its CPU side returned: a long kernel
    chain on the comm stream on CUDA, a sleep on CPU."""
    real = engine.strategy.run_round

    def slow(ctx, req):
        if device == "cuda":
            a = torch.randn(2048, 2048, device="cuda")
            for _ in range(20):
                a = a @ a / a.norm()
        else:
            time.sleep(0.02)
        return real(ctx, req)
    engine.strategy.run_round = slow


@pytest.mark.parametrize("device", DEVICES)
def test_adaptive_overlap_with_slow_comm_stream_keeps_order(device):
    """A slow round must not be installed before it is done: the compute stream waits on its
    event (CUDA), the compute loop on its handle (CPU); results match the reference."""
    model = tiny_model(0).to(device)
    cfg = EngineConfig(strategy="acco", lr=1e-2, micro_batches=1, accumulation="grow", max_steps=6,
                       align=8, poison_freed_buffers=True)
    engine = Engine(model, cfg, mse_loss)
    slow_run_round(engine, device)
    engine.fit(worker_stream(0, 2000))
    engine.close()
    assert sum(engine.round_counts) > len(engine.round_counts)  # the slow rounds let it grow
    want = Reference(tiny_model(0), [worker_stream(0, 2000)], 1, lr=1e-2, round_counts=[engine.round_counts],
                     weight_decay=0.0).run("acco", 6)
    assert rel_err(flat_params(model).cpu(), want[-1]) < 1e-5


@pytest.mark.gpu
@CUDA
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


@pytest.mark.gpu
@CUDA
def test_micro_batch_loop_makes_no_host_sync():
    """The compute side's micro-batches (placement from CPU, forward, backward, accumulation,
    the CUDA-event clock) under set_sync_debug_mode('error'): a sync raises."""
    engine = Engine(tiny_model(0).cuda(), EngineConfig(strategy="acco", micro_batches=50, accumulation="fixed",
                                                       max_steps=2, align=8), mse_loss)
    batches = worker_stream(0, 40)
    with sync_debug_error():
        for b in batches:
            engine._micro_batch(b)
    engine.clock.flush()
    assert engine.state.pending_count == 40
    engine.close()


@pytest.mark.gpu
@CUDA
def test_device_clock_measures_kernels_not_launches():
    """A micro-batch whose kernels take long but launch fast: the CUDA-event clock sees the
    kernels' time, perf_counter around the launch would not."""
    from engine.runtime.clock import DeviceClock

    clock, got = DeviceClock(torch.device("cuda")), []
    a = torch.randn(4096, 4096, device="cuda")
    start, t0 = clock.start(), time.perf_counter()
    for _ in range(10):
        a = a @ a / a.norm()
    launch = time.perf_counter() - t0
    clock.stop(start, lambda s, e: got.append(e - s))
    clock.flush()
    assert got and got[0] > 2 * launch


def _nccl_world2(rank, world):
    torch.cuda.set_device(rank)
    model = tiny_model(0).cuda()
    cfg = EngineConfig(strategy="acco", codec="loco4", param_codec="int8", lr=1e-2, micro_batches=2,
                       accumulation="fixed", max_steps=6, align=8, group_size=8, poison_freed_buffers=True)
    engine = Engine(model, cfg, mse_loss)
    engine.fit(worker_stream(rank, 40))  # CPU batches: the engine places them
    engine.close()
    return flat_params(model).cpu()


@pytest.mark.gpu
@TWO_GPUS
def test_nccl_world2_replicas_agree():
    """Two ranks over NCCL (collectives on the comm stream): both replicas end bit-identical."""
    a, b = spawn(_nccl_world2, 2)
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_compute_dtype_casts_parameters_not_buffers():
    """compute_dtype='bfloat16' casts the parameters; a float32 buffer (Llama's rotary
    ``inv_freq``) keeps its dtype and its bits."""
    model = tiny_model(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    model.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
    engine = Engine(model, EngineConfig(compute_dtype="bfloat16", max_steps=1, align=8), mse_loss)
    engine.close()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, inv_freq)
