"""The engine owns device placement (engine/runtime/placement.py): every micro-batch, however nested,
reaches the model's device, from pinned memory with non_blocking on CUDA; a batch already there
and a CPU model cost nothing. Proved without a GPU, with two stand-ins for a device: fake CUDA
tensors (FakeTensorMode, where mixing devices raises as on a GPU) for the CUDA copies, and the
meta device (a non-CPU device whose mismatches raise too) for the engine's micro-batch path and
the recipe's data path, forward and backward: a CPU-only build aborts in C++ on autograd through
a fake CUDA leaf and refuses to index one. The two engine tests fail on the code before
placement (checked)."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from engine import Engine, EngineConfig
from engine.runtime.placement import Placement, map_tensors, tensors_of, to_device
from tests.engine.fake_cuda import CUDA, fake_cuda, record_input_devices
from tests.tiny import mse_loss, tiny_model, worker_stream

Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Sample:
    inputs: dict
    extra: list
    name: str = "s"


def nested(x: torch.Tensor, y: torch.Tensor):
    """Tensors in every container a user may hand the engine."""
    from transformers import BatchEncoding

    return {"enc": BatchEncoding({"ids": x, "mask": y}), "pair": Pair(x, y), "tup": (x, [y, 3]),
            "dc": Sample({"a": x}, [y, None]), "n": 7}


def test_to_device_moves_every_nested_tensor_and_keeps_the_rest():
    x, y = torch.ones(2, 3), torch.zeros(2)
    moved = to_device(nested(x, y), torch.device("meta"))
    got = tensors_of(moved)
    assert len(got) == 8 and all(t.device.type == "meta" for t in got)
    assert type(moved["enc"]).__name__ == "BatchEncoding" and isinstance(moved["pair"], Pair)
    assert isinstance(moved["dc"], Sample) and moved["dc"].name == "s" and moved["dc"].extra[1] is None
    assert moved["tup"][1][1] == 3 and moved["n"] == 7 and isinstance(moved["tup"], tuple)
    assert [t.shape for t in got] == [t.shape for t in tensors_of(nested(x, y))]


def test_cpu_placement_is_a_no_op():
    batch = nested(torch.ones(2, 3), torch.zeros(2))
    assert Placement(torch.device("cpu"))(batch) is batch  # the same object: nothing rebuilt or copied
    assert map_tensors(batch, lambda t: t) is batch


def test_cuda_placement_copies_from_pinned_memory_non_blocking():
    batch = nested(torch.ones(2, 3), torch.zeros(2))
    with fake_cuda() as (_, shim):
        moved = Placement(CUDA)(batch)
        assert all(t.device == CUDA for t in tensors_of(moved))
        assert len(shim.copies) == 8  # one per tensor
        assert all(dev == CUDA and non_blocking and pinned for dev, non_blocking, pinned in shim.copies)


def test_a_batch_already_on_the_device_is_left_alone():
    with fake_cuda() as (_, shim):
        batch = {"x": torch.ones(2, 3, device="cuda"), "y": [torch.zeros(2, device="cuda")]}
        assert Placement(CUDA)(batch) is batch
        assert shim.copies == []


class TinyCausalLM(torch.nn.Module):
    """model(input_ids=, labels=).loss, as a Hugging Face causal LM answers hf_lm_loss. (GPT-2
    itself reads token values inside its forward, to build masks: neither fake nor meta tensors
    have values, so the recipe's data path is shown with this stand-in of the same interface.)"""

    def __init__(self, vocab: int = 257, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss)


def test_recipe_data_path_reaches_the_model_device():
    """The recipe's stream (TokenBatches, label_mode 'hf') and loss (hf_lm_loss) with a model moved
    off the CPU as the recipe moves it (meta here: a CPU-only build's Python bindings refuse to
    index a fake CUDA tensor), through Engine._micro_batch: every input of every submodule is on
    the model's device and the backward runs; the CPU batch as the recipe handed it before raises
    at the first micro-batch (issue 23)."""
    from lm.data import TokenBatches, hf_lm_loss

    stream = TokenBatches(torch.randint(0, 257, (2000,)), 32, 2, seed=0)
    model = TinyCausalLM()
    engine = Engine(model, EngineConfig(micro_batches=2, accumulation="fixed", max_steps=2, align=8), hf_lm_loss)
    try:
        meta = torch.device("meta")
        model.to(meta)
        with pytest.raises(RuntimeError, match="device"):
            hf_lm_loss(model, stream.batch(0))
        engine.device, engine.placement = meta, Placement(meta)
        engine.state.start_accumulator(meta)
        seen = record_input_devices(model)
        for _, batch in zip(range(2), stream.iter_from(0)):
            engine._micro_batch(batch)
        assert seen and set(seen) == {meta}
        assert engine.state.pending_count == 2 and engine.state.pending_samples == 4
        assert all(p.grad is not None and p.grad.device == meta for p in model.parameters() if p.requires_grad)
    finally:
        engine.close()


def test_engine_micro_batch_puts_every_input_on_the_model_device():
    """Engine._micro_batch on a model that lives off the CPU (meta) given CPU micro-batches: the
    forward sees only device tensors, the backward runs, and the counters move; today's code
    (no placement) raises at the first micro-batch."""
    engine = Engine(tiny_model(0), EngineConfig(micro_batches=2, accumulation="fixed", max_steps=2, align=8),
                    mse_loss)
    try:
        meta = torch.device("meta")
        engine.model.to(meta)
        engine.device, engine.placement = meta, Placement(meta)
        engine.state.start_accumulator(meta)
        seen = record_input_devices(engine.model)
        for batch in worker_stream(0, 2):
            engine._micro_batch(batch)
        assert len(seen) == 2 * 4 and set(seen) == {meta}  # Sequential, Linear, Tanh, Linear per micro-batch
        assert engine.state.pending_count == 2 and engine.state.consumed == 2
        assert all(p.grad is not None and p.grad.device == meta for p in engine.model.parameters())
    finally:
        engine.close()


def test_engine_fit_on_cpu_is_unchanged_by_placement():
    """On CPU the placement is a no-op: the same batches train to the same bits with user batches
    that are plain tuples or tuples inside a dict through a loss_fn that unpacks them."""
    a = Engine(tiny_model(0), EngineConfig(micro_batches=2, accumulation="fixed", max_steps=3, align=8), mse_loss)
    a.fit(worker_stream(0, 6))
    a.close()
    b = Engine(tiny_model(0), EngineConfig(micro_batches=2, accumulation="fixed", max_steps=3, align=8),
               lambda m, batch: mse_loss(m, batch["xy"]))
    b.fit([{"xy": xy} for xy in worker_stream(0, 6)])
    b.close()
    assert torch.equal(a.flat.data, b.flat.data)
