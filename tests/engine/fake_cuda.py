"""Fake CUDA tensors on a CPU-only build, for tests of device placement without a GPU.

``torch._subclasses.FakeTensorMode`` makes tensors that carry a device (``cuda:0`` included) and
shapes but no data; an op that mixes devices raises ``FakeTensorDeviceMismatchError`` exactly as
a real GPU run raises "Expected all tensors to be on the same device". One gap: on a CPU-only
build the Python binding of ``Tensor.to``/``Tensor.cuda`` refuses a CUDA target before the op is
dispatched ("not linked with support for cuda devices"), and ``pin_memory`` needs the CUDA host
allocator. ``CudaOnCpuBuild`` routes those calls to the aten op they dispatch to
(``aten._to_copy``: the same op, the same fake result) and records what was asked: the copies'
``non_blocking`` flags and which host tensors were pinned. Other limits of a CPU-only build, for
which the tests use the meta device instead: indexing a fake CUDA tensor raises in the binding,
and autograd through a fake CUDA leaf that requires grad aborts the process in C++.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses import FakeTensorMode
from torch.overrides import TorchFunctionMode

CUDA = torch.device("cuda", 0)


class CudaOnCpuBuild(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.copies: list[tuple[torch.device, bool, bool]] = []  # (target, non_blocking, from pinned)
        self._pinned: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            self._pinned.add(id(args[0]))
            return args[0]
        if func is torch.Tensor.is_pinned:
            return id(args[0]) in self._pinned
        if func is torch.Tensor.cuda:
            return self._to(args[0], CUDA, None, bool(kwargs.get("non_blocking", False)))
        if func is torch.Tensor.to:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "cuda":
                return self._to(args[0], device, dtype, non_blocking)
        return func(*args, **kwargs)

    def _to(self, t: torch.Tensor, device: torch.device, dtype, non_blocking: bool) -> torch.Tensor:
        device = torch.device("cuda", 0 if device.index is None else device.index)
        self.copies.append((device, non_blocking, id(t) in self._pinned))
        if t.device == device and (dtype is None or dtype == t.dtype):
            return t
        return torch.ops.aten._to_copy.default(t, device=device, dtype=dtype or t.dtype, non_blocking=non_blocking)


@contextlib.contextmanager
def fake_cuda():
    """(fake mode, shim) active together: tensors made inside are fake, CUDA ones included."""
    shim = CudaOnCpuBuild()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, shim:
        yield mode, shim


def record_input_devices(model: torch.nn.Module) -> list[torch.device]:
    """The device of every tensor argument of every submodule's forward, as it runs."""
    seen: list[torch.device] = []

    def hook(module, args, kwargs):
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, torch.Tensor):
                seen.append(v.device)
    for m in model.modules():
        m.register_forward_pre_hook(hook, with_kwargs=True)
    return seen

