"""The fused CPU kernels (acco_loco/kernels.py) and devices: a kernel handed a tensor that is not
on the CPU (meta, fake CUDA) or a null address raises a clear ValueError before any C code runs
(it would segfault there); on a CUDA node the CPU kernels are never built unless asked for (the
device decision is mocked: no GPU here)."""

from __future__ import annotations


import pytest
import torch

from acco_loco import kernels
from acco_loco.optim import OptimizerSpec
from engine import Engine, EngineConfig
from tests.engine.fake_cuda import fake_cuda
from tests.tiny import mse_loss, tiny_model, worker_stream



@pytest.fixture
def kernel_state():
    """Leave the module as the test found it."""
    saved = kernels._lib, kernels._state, kernels._forced
    yield
    kernels._lib, kernels._state, kernels._forced = saved


@pytest.fixture
def built(kernel_state):
    kernels.use(True)
    if not kernels.available():
        pytest.skip("the kernels do not build here (no compiler): nothing could reach C code")


def test_adamw_refuses_meta_and_fake_cuda_tensors(built):
    spec = OptimizerSpec()
    cpu = [torch.zeros(64) for _ in range(8)]
    meta = [t.to("meta") for t in cpu]
    with pytest.raises(ValueError, match="CPU code: grad_sum is a tensor on meta"):
        kernels.adamw(meta[0], 1, 1.0, *cpu[1:7], 1e-3, 1, spec, cpu[7])
    with pytest.raises(ValueError, match="v_out is a tensor on meta"):
        kernels.adamw(*cpu[:1], 1, 1.0, *cpu[1:5], meta[5], cpu[6], 1e-3, 1, spec, cpu[7])
    with fake_cuda():
        dev = [torch.zeros(64, device="cuda") for _ in range(8)]
        with pytest.raises(ValueError, match="on cuda:0"):
            kernels.adamw(dev[0], 1, 1.0, *dev[1:7], 1e-3, 1, spec, dev[7])


def test_address_kernels_refuse_non_cpu_tensors_and_null_addresses(built):
    x, out = torch.zeros(2, 16), torch.zeros(64, dtype=torch.uint8)
    meta = x.to("meta")
    assert meta.data_ptr() == 0  # what a meta tensor's address is: the C code would write through it
    with pytest.raises(ValueError, match="null address"):
        kernels.encode(meta.data_ptr(), 2, 16, 16, 1.0, 8, 8, out.data_ptr(), 32, 16)
    with pytest.raises(ValueError, match="x is a tensor on meta"):
        kernels.encode(meta, 2, 16, 16, 1.0, 8, 8, out, 32, 16)
    with pytest.raises(ValueError, match="held is a tensor on meta"):
        kernels.decode_add(out, 2, 32, 16, 16, 8, 8, meta, 16)
    with fake_cuda():
        dev = torch.zeros(64, device="cuda")
        with pytest.raises(ValueError, match="new is a tensor on cuda:0"):
            kernels.delta_encode(dev, x, 16, 8, 8, out, 16)
    # the same call on CPU tensors runs (the guard refuses only what the C code cannot take)
    assert kernels.encode(x, 2, 16, 16, 1.0, 8, 8, out, 32, 16) is False
    assert not kernels.fits(meta)


def test_never_built_on_a_cuda_node(kernel_state, monkeypatch):
    def no_build():
        raise AssertionError("the CPU kernels were compiled on a CUDA node")
    monkeypatch.setattr(kernels, "_cuda_node", lambda: True)
    monkeypatch.setattr(kernels, "_build", no_build)
    monkeypatch.delenv("ACCO_LOCO_KERNELS", raising=False)
    kernels._lib, kernels._state, kernels._forced = None, "unbuilt", False
    assert not kernels.available()
    # an engine whose parameter codec would use them (DeltaParams asks at construction) trains on
    # the torch path without building anything
    kernels._state = "unbuilt"
    engine = Engine(tiny_model(0), EngineConfig(strategy="acco", codec="loco4", param_codec="int8", group_size=8,
                                                micro_batches=1, accumulation="fixed", max_steps=2, align=8),
                    mse_loss)
    assert not engine.ctx.params.fused and not engine.ctx.grads.fused
    assert len(engine.fit(worker_stream(0, 4))) == 2
    engine.close()


def test_a_cuda_node_builds_them_when_asked(kernel_state, monkeypatch):
    calls = []

    def fake_build():
        calls.append(1)
        raise RuntimeError("(not really building in this test)")
    monkeypatch.setattr(kernels, "_cuda_node", lambda: True)
    monkeypatch.setattr(kernels, "_build", fake_build)
    monkeypatch.setenv("ACCO_LOCO_KERNELS", "1")
    kernels._lib, kernels._state, kernels._forced = None, "unbuilt", False
    assert not kernels.available() and calls == [1]  # asked for: it tried (and fell back to torch)
    monkeypatch.delenv("ACCO_LOCO_KERNELS")
    kernels.use(True)  # the tests' switch asks for them too
    assert not kernels.available() and calls == [1, 1]
