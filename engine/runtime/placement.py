"""Device placement of micro-batches: the engine, not the user, moves every batch to the model's
device (docs/gpu.md).

``to_device(batch, device)`` moves every tensor nested in dicts (and other mappings, Hugging
Face ``BatchEncoding`` included), lists, tuples, named tuples and dataclasses; everything else
(ints, strings, None) is kept as is. A tensor already on the device is left alone (no copy), and
on a CPU model a CPU batch is returned unchanged: placement costs nothing there.

``Placement`` is what the engine calls for each micro-batch. On CUDA it copies a host batch
from pinned memory with ``non_blocking`` on a copy stream of its own, and the compute stream
waits on that copy's event only: the host never waits for the copy, and since the host runs
ahead of the GPU (no host syncs in the micro-batch loop), the copy of micro-batch k+1 is issued
and runs on the copy stream while the GPU still computes micro-batch k. That is the prefetch;
nothing is pulled from the user's iterator ahead of time, so the engine's dealing of a global
stream and ``engine.consumed`` (resume) do not change. The device tensors are made on the copy
stream and used and freed on the compute stream: each gets ``record_stream`` so that the caching
allocator does not hand its memory to the copy stream again before the compute stream is done.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Mapping
from typing import Any, Callable

import torch


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor nested in it; containers are rebuilt only
    when something inside changed (a batch already in place comes back as the same object)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, UserDict):  # Hugging Face BatchEncoding: keep its type and extras
        data = {k: map_tensors(v, fn) for k, v in batch.data.items()}
        if all(data[k] is v for k, v in batch.data.items()):
            return batch
        out = copy.copy(batch)
        out.data = data
        return out
    if isinstance(batch, Mapping):
        items = {k: map_tensors(v, fn) for k, v in batch.items()}
        if all(items[k] is v for k, v in batch.items()):
            return batch
        try:
            return type(batch)(items)
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        items = [map_tensors(v, fn) for v in batch]
        return batch if all(a is b for a, b in zip(items, batch)) else type(batch)(*items)
    if isinstance(batch, (list, tuple)):
        items = [map_tensors(v, fn) for v in batch]
        if all(a is b for a, b in zip(items, batch)):
            return batch
        return items if isinstance(batch, list) else type(batch)(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {}
        for f in dataclasses.fields(batch):
            if not f.init:
                continue
            v = getattr(batch, f.name)
            new = map_tensors(v, fn)
            if new is not v:
                changes[f.name] = new
        return dataclasses.replace(batch, **changes) if changes else batch
    return batch


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor nested in ``batch``, in order."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t
    map_tensors(batch, keep)
    return found


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def to_device(batch: Any, device: torch.device, *, pin: bool = False, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor on ``device``; tensors already there are not copied. With
    ``pin``, host tensors are copied through pinned memory first (a no-op for pinned ones)."""
    device = torch.device(device)

    def move(t: torch.Tensor) -> torch.Tensor:
        if _same_device(t, device):
            return t
        if pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=non_blocking)
    return map_tensors(batch, move)


class Placement:
    """Moves the engine's micro-batches to ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # a copy stream needs a real CUDA runtime; without one (fake CUDA tensors in the CPU
        # tests) the copies go on the current stream, still from pinned memory
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda and torch.cuda.is_available() else None

    def __call__(self, batch: Any) -> Any:
        if not self.cuda:
            return to_device(batch, self.device)  # CPU: no copy unless a batch is elsewhere
        if not any(not _same_device(t, self.device) for t in tensors_of(batch)):
            return batch  # the user's batch is already on the device
        if self.stream is None:
            return to_device(batch, self.device, pin=True, non_blocking=True)
        compute = torch.cuda.current_stream(self.device)
        # no wait for the compute stream: the copy writes fresh memory of the copy stream's pool
        # from a fresh pinned host buffer, so it may run while micro-batch k still computes
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device, pin=True, non_blocking=True)
        compute.wait_stream(self.stream)
        for t in tensors_of(moved):
            if t.device.type == "cuda":
                t.record_stream(compute)  # made on the copy stream, used and freed on compute
        return moved
