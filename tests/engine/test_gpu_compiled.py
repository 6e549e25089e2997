"""The engine's compiled encode + error feedback (acco_loco/compiled.py), checked on CPU: the
reducer takes it where ``compiled.available`` says (a GPU with Triton), a failed compile falls
back to the eager code with the error state untouched, and the compiled code gives the eager
payload's bits (Inductor's C++ on CPU: slow; on a GPU benchmarks/gpu_check.py's codecs part)."""

from __future__ import annotations

import logging

import pytest
import torch

from acco_loco import compiled, kernels
from acco_loco.feedback import ErrorFeedback
from acco_loco.feedback import compress as eager_compress
from acco_loco.registry import make_codec
from engine import Engine, EngineConfig
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream


@pytest.fixture(autouse=True)
def fresh():
    compiled.reset()
    yield
    compiled.reset()


def _x(n=1024, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_only_a_gpu_with_triton_compiles(monkeypatch):
    assert not compiled.available("cpu")
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: True)
    assert compiled.available("cuda")
    monkeypatch.setenv("ACCO_LOCO_COMPILE", "0")
    assert not compiled.available("cuda")


def _pieced(fb, codec, x, run, piece=256):
    """One round of the reducer's pass over ``x`` in pieces: the payloads, scales concatenated."""
    out = []
    with fb.in_pieces(codec, run=run) as encode:
        for a in range(0, x.numel(), piece):
            out.append(encode(x[a:a + piece].clone(), a))
    return torch.cat([p for p, _ in out]), torch.cat([s for _, s in out])


# the whole buffer (gpu_check's codec timing) and the reducer's pieces: compiled, then eager
PATHS = {"whole": (lambda fb, codec, x: compiled.compress(x, codec, fb),
                   lambda fb, codec, x: eager_compress(x, codec, fb, check_finite=False)),
         "pieces": (lambda fb, codec, x: _pieced(fb, codec, x, compiled.compress_piece),
                    lambda fb, codec, x: _pieced(fb, codec, x, None))}


@pytest.mark.parametrize("path", PATHS)
def test_a_failed_compile_falls_back_to_eager_with_the_state_untouched(monkeypatch, caplog, path):
    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no Triton here")
        return run
    monkeypatch.setattr(compiled.torch, "compile", broken)
    run, eager = PATHS[path]
    codec = make_codec("int4", group_size=128)
    fb, ref = (ErrorFeedback("loco", 1024, device="cpu") for _ in range(2))
    with caplog.at_level(logging.WARNING, logger="acco_loco"):
        for seed in range(3):
            got, want = run(fb, codec, _x(seed=seed)), eager(ref, codec, _x(seed=seed))
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert compiled.failed.startswith("RuntimeError: no Triton here")
    assert sum("compiling the encode + error feedback failed" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(fb.error(), ref.error())
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: True)
    assert not compiled.available("cuda")  # given up for good


def test_the_reducer_runs_the_compiled_path_where_available(monkeypatch):
    """ACCO with loco4 on the torch path (the fused CPU kernels off, as on a GPU): with the
    compiled path taken (torch.compile stubbed: the same function) the run is the eager run."""
    calls = []

    def run(compiled_on: bool):
        monkeypatch.setattr(compiled, "available", lambda device: compiled_on)
        monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: (lambda *a: calls.append(1) or fn(*a)))
        compiled.reset()
        kernels.use(False)
        try:
            eng = Engine(tiny_model(0), EngineConfig(strategy="acco", codec="loco4", param_codec="int8", lr=1e-2,
                                                     micro_batches=2, accumulation="fixed", max_steps=4, align=8,
                                                     group_size=8), mse_loss)
            eng.fit(worker_stream(0, 40))
            eng.close()
        finally:
            kernels.use(True)
        return flat_params(eng.model)
    eager = run(False)
    assert calls == []
    # every round's encode after the first (whose error is known zero: eager, no graph of its
    # own) went through it, piece by piece (temporaries one piece long)
    assert torch.equal(run(True), eager) and len(calls) >= 6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_compiled_encode_and_feedback_give_the_eager_payload(name):
    """Really compiled (Inductor's C++ on CPU): the first round's payload and scales are the
    eager bits; later rounds compensate ``x + q * scale`` (one rounding apart at most where a
    multiply-add fuses differently), so their decoded values stay within that of eager's."""
    codec = make_codec(name, group_size=128)
    fb, ref = (ErrorFeedback("loco", 4096, device="cpu") for _ in range(2))
    for seed in range(3):
        p, s, sent = compiled.compress(_x(4096, seed), codec, fb)
        wp, ws, wsent = eager_compress(_x(4096, seed), codec, ref, check_finite=False)
        assert compiled.failed is None
        if seed == 0:
            assert torch.equal(p, wp) and torch.equal(s, ws) and torch.equal(sent, wsent)
        else:
            assert (sent - wsent).abs().max() <= 2 * s.max()  # at most one level of the codec apart
            assert (p != wp).float().mean() < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_compiled_pieces_give_the_eager_pieces(name):
    """The engine's compiled path, really compiled (Inductor's C++ on CPU): pieces of 256 values
    of a 4096-value buffer over three rounds give eager's first-round bits (that round runs
    eager: its error is known zero), and later rounds within one codec level (the compensation's
    multiply-add may fuse differently); one graph serves every piece of a length (no recompile
    per offset)."""
    codec = make_codec(name, group_size=128)
    fb, ref = (ErrorFeedback("loco", 4096, device="cpu") for _ in range(2))
    for seed in range(3):
        p, s = _pieced(fb, codec, _x(4096, seed), compiled.compress_piece)
        wp, ws = _pieced(ref, codec, _x(4096, seed), None)
        assert compiled.failed is None
        if seed == 0:
            assert torch.equal(p, wp) and torch.equal(s, ws)
        else:
            assert (p != wp).float().mean() < 0.01
            assert (codec.decode(p, s) - codec.decode(wp, ws)).abs().max() <= 2 * s.max()
    assert (fb.error() - ref.error()).abs().max() <= 2 * ref.error().abs().max() / 127


def test_more_piece_lengths_than_dynamos_default_limit_stay_compiled(monkeypatch):
    """Each (codec, piece length) is a graph of its own; a run with more than Dynamo's default 8
    (two codecs, the last piece's length, the check's sizes: 8 were hit on the second H200 run)
    keeps the compiled path instead of falling back to eager for good. Traced by Dynamo with
    the eager backend (the limit is Dynamo's; no Inductor compile needed to reach it)."""
    real_compile = torch.compile
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw))
    torch._dynamo.reset()
    compiled.reset()
    codec = make_codec("int8", group_size=128)
    lengths = [128 * (i + 1) for i in range(10)]
    for n in lengths:
        fb = ErrorFeedback("loco", n, device="cpu")
        for zero in (True, False):  # the first round (error known zero) runs eager
            compiled.compress_piece(_x(n, n), codec, fb._state(0, n), fb._codec, fb.beta, zero, True)
    assert compiled.failed is None, compiled.failed
    torch._dynamo.reset()
    compiled.reset()
