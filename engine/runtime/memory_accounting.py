"""What a rank's training state really occupies, to hold against the formula of
engine/planner/memory.py (docs/design/zero1.md, "Flat buffer, padding, shards").

``held_bytes`` walks what the model and the engine's parts reference and adds up the unique
tensor *storages* (a view counts its whole storage once, a storage seen twice counts once), by
category, the first category that reaches a storage owning it:

    parameters      the model's parameters and buffers (the trainable ones view the flat buffer;
                    FSDP2's: the local shards of a DTensor), and whatever else the flat buffer holds
    gradients       the flat gradient buffers
    gathered        the full parameters every replica holds after a round, in a buffer of their own
                    (``gather_buf``); none where a round gathers into the gradient buffer it has
                    reduced (``RoundContext.gather_target``): those bytes are the gradients'
    optimizer       the owned shard's fp32 master and moments, and the spare a step is proposed into
                    (with optimizer_offload='cpu': the device staging slots only; the state is in
                    host memory, counted by ``host_held_bytes`` and never here)
    error_feedback  the compressed reducer's error state and its rollback copy
    strategy        what the strategy keeps between rounds (ACCO's kept estimate half)
    comm            the reducer's and gatherer's kept buffers, every Comm's ``_buffers``

``RoundTemporaries`` measures the other part, the largest set of temporaries alive at once
during a round, with a torch dispatch mode (``torch.utils._python_dispatch``) on the thread that
runs the round: every storage an op creates (an output aliasing none of the op's inputs) is
counted from its creation until the last tensor that views it is freed (weak references);
kept buffers made in a round (a first round's) count as live and never end. What runs outside
torch's dispatcher is not seen: gloo's and NCCL's own staging, the fused CPU kernels (which
write into buffers they are given), and allocations inside one aten kernel.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import fields, is_dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

CATEGORIES = ("parameters", "gradients", "gathered", "optimizer", "error_feedback", "strategy", "comm")
_OWN_PACKAGES = ("engine", "acco_loco", "lm")  # objects of these packages are walked into


def _tensors(obj, seen: set[int]):
    """Every tensor reachable from ``obj`` through containers, dataclasses and the attributes of
    this project's objects (a Parameter's ``.grad`` included); each object visited once."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if o is None or isinstance(o, (str, bytes, int, float, bool, torch.device, torch.dtype)):
            continue
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            local = getattr(o, "_local_tensor", None)  # a DTensor (FSDP2): its local shard holds the storage
            yield o if local is None else local
            if o.is_leaf and o.grad is not None:
                stack.append(o.grad)
        elif isinstance(o, torch.nn.Module):
            stack.extend(o.parameters())
            stack.extend(o.buffers())
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif is_dataclass(o):
            stack.extend(getattr(o, f.name, None) for f in fields(o))
            stack.extend(getattr(o, "__dict__", {}).values())
        elif type(o).__module__.split(".")[0] in _OWN_PACKAGES:
            stack.extend(getattr(o, "__dict__", {}).values())
            for name in getattr(type(o), "__slots__", ()):
                stack.append(getattr(o, name, None))


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def held_bytes(model: torch.nn.Module, ctx, strategy=None, **extra) -> dict[str, int]:
    """Bytes of the unique tensor storages the model and the engine's parts hold, by category
    (CATEGORIES, then the names of ``extra``: further roots a layout adds, walked last).
    ``ctx``: the engine's RoundContext; ``strategy``: the engine's strategy object. Device bytes
    only: what an offloaded optimizer keeps in host memory (``host_held_bytes``) is left out."""
    offload = getattr(strategy, "offload", None)
    roots = [
        ("gradients", [ctx.flat.grads]),  # first: a parameter's .grad views a gradient buffer
        ("parameters", [model, ctx.flat]),  # (a node-sharded run's flat holds no copy of them)
        ("gathered", [ctx.gather_buf]),
        ("optimizer", [ctx.shard_state, offload.device_tensors() if offload is not None else None]),
        ("error_feedback", [getattr(ctx.grads, "feedback", None)]),
        ("strategy", [strategy]),
        ("comm", [ctx.grads, ctx.params, ctx.comm]),
    ] + [(name, [root]) for name, root in extra.items()]
    out = {name: 0 for name in CATEGORIES + tuple(extra)}
    owned = _host_storages(offload)  # claimed first: in no device category
    for name, objs in roots:
        visited: set[int] = set()  # each category walks the whole graph below its roots
        for obj in objs:
            for t in _tensors(obj, visited):
                ptr, nbytes = _storage(t)
                if ptr == 0 or ptr in owned:
                    continue
                owned.add(ptr)
                out[name] += nbytes
    return out


def _host_storages(offload) -> set[int]:
    return set() if offload is None else {_storage(t)[0] for t in offload.host_tensors()} - {0}


def host_held_bytes(strategy) -> int:
    """Bytes of the unique storages an offloaded optimizer (optimizer_offload='cpu',
    engine/runtime/offload.py) keeps in host memory: its master, moments, spare or scratch, the
    host copy of the reduced gradient and the fused kernel's scratch; 0 without offload."""
    offload = getattr(strategy, "offload", None)
    seen: dict[int, int] = {}
    for t in offload.host_tensors() if offload is not None else ():
        ptr, nbytes = _storage(t)
        if ptr:
            seen[ptr] = nbytes
    return sum(seen.values())


def fsdp_unsharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the unsharded parameters and all-gather outputs FSDP2 still holds (0 once every
    unit has resharded: after a step with ``reshard_after_forward``, what
    engine/planner/memory.py assumes). Reads FSDP2's per-parameter state (private attributes of
    torch 2.x's ``FSDPParam``: ``_unsharded_param``, ``all_gather_outputs``)."""
    from torch.distributed.fsdp import FSDPModule

    total, seen = 0, set()
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            for t in [*getattr(param, "all_gather_outputs", ()), getattr(param, "_unsharded_param", None)]:
                ptr, nbytes = _storage(t) if t is not None else (0, 0)
                if ptr and ptr not in seen:
                    seen.add(ptr)
                    total += nbytes
    return total


class RoundTemporaries(TorchDispatchMode):
    """Live bytes of the storages created under this mode (on this thread), and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage -> [bytes, tensors alive that view it]
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, inputs)
        return out

    def _see(self, t: torch.Tensor, inputs: set[int]) -> None:
        ptr, nbytes = _storage(t)
        with self._lock:
            rec = self._refs.get(ptr)
            if rec is None:
                if ptr == 0 or ptr in inputs:
                    return  # empty, or a view / in-place result of a storage made elsewhere
                rec = self._refs[ptr] = [nbytes, 0]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            rec[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        with self._lock:
            rec = self._refs.get(ptr)
            if rec is None:
                return
            rec[1] -= 1
            if rec[1] == 0:
                self.live -= rec[0]
                del self._refs[ptr]


def track_round_temporaries(strategy) -> list[int]:
    """Wrap ``strategy`` (an engine's) so that every round runs under a RoundTemporaries; returns
    the list each round's peak (bytes) is appended to."""
    peaks: list[int] = []
    run_round = strategy.run_round

    def tracked(ctx, req):
        with RoundTemporaries() as mode:
            result = run_round(ctx, req)
        peaks.append(mode.peak)
        return result

    strategy.run_round = tracked
    return peaks
