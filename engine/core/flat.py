"""Flat buffers: all trainable params and grads in one contiguous padded buffer.

Model ``.data`` and ``.grad`` tensors are views into these buffers, so a round hands the whole
gradient to the communication side as one tensor and installs new parameters with one copy.
With a gradient dtype other than the parameters' (grad_dtype, engine/core/dtypes.py: fp32 buffers
for bf16 parameters) ``.grad`` is no view: a post-accumulate-grad hook adds each parameter's
gradient into its slice of the buffer as its backward produces it, then drops it (``.grad`` is
None between backwards), so one parameter's compute-dtype gradient at a time lives beside the buffer.
Padding makes the length a multiple of world_size * align so every shard has the same size and
is a whole number of codec groups. Frozen params stay out.
"""

from __future__ import annotations

import torch

from acco_loco.matrix_layout import place


class FlatParams:
    def __init__(self, params: list[torch.nn.Parameter], names: list[str], world_size: int,
                 align: int, dtype: torch.dtype, grad_buffers: int = 2, grad_dtype: torch.dtype | None = None,
                 whole: list[bool] | None = None):
        if not params:
            raise ValueError("the model has no trainable parameters (every requires_grad is False): "
                             "unfreeze at least one parameter")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"trainable parameters live on several devices {sorted(map(str, devices))}: "
                             "move the model to one device before building the engine")
        self.device = params[0].device
        self.dtype = dtype
        self.params = params
        self.names = names
        self.world_size = world_size
        self.numel = sum(p.numel() for p in params)
        sizes = [p.numel() for p in params]
        if whole is not None and any(whole):
            # parameters an optimizer steps whole (Muon's matrices) stay in one shard each:
            # acco_loco/matrix_layout.py packs them, the others fill around them in model order
            starts, self.shard_size = place(sizes, whole, world_size, align)
            self.padded = self.shard_size * world_size
        else:
            unit = world_size * align
            self.padded = -(-self.numel // unit) * unit
            self.shard_size = self.padded // world_size
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.offsets: list[tuple[int, int]] = [(a, a + n) for a, n in zip(starts, sizes)]
        # (start, rows, cols) of each whole parameter, sorted by start
        self.matrices = sorted((a, *p.shape) for (a, _), p, w in zip(self.offsets, params, whole or [])
                               if w) if whole else []

        self.data = torch.zeros(self.padded, dtype=dtype, device=self.device)
        with torch.no_grad():
            for p, (a, b) in zip(params, self.offsets):
                self.data[a:b].copy_(p.detach().reshape(-1))
                p.data = self.data[a:b].view(p.shape)
        self.grad_dtype = dtype if grad_dtype is None else grad_dtype
        self.grads = [torch.zeros(self.padded, dtype=self.grad_dtype, device=self.device)
                      for _ in range(grad_buffers)]
        self.active = 0
        self.hooked = self.grad_dtype != dtype  # .grad is added into the buffer, not a view of it
        self._hooks = [param.register_post_accumulate_grad_hook(self._add_grad_hook(i))
                       for i, param in enumerate(params)] if self.hooked else []
        self.point_grads(0)

    def _add_grad_hook(self, i: int):
        a, b = self.offsets[i]

        def add_into_buffer(p: torch.Tensor) -> None:
            with torch.no_grad():
                self.grads[self.active][a:b].view(p.shape).add_(p.grad)  # exact cast, fp32 add
            p.grad = None

        return add_into_buffer

    def point_grads(self, index: int) -> None:
        """Make every param's .grad a view of gradient buffer ``index`` (hooked: backwards add
        into buffer ``index`` from now on)."""
        self.active = index
        buf = self.grads[index]
        for p, (a, b) in zip(self.params, self.offsets):
            p.grad = None if self.hooked else buf[a:b].view(p.shape)

    def check_grads_attached(self) -> None:
        """Raise if something replaced a .grad (e.g. zero_grad(set_to_none=True)); hooked: if a
        .grad is set, which no backward leaves (the hook takes it)."""
        buf = self.grads[self.active]
        for p, name, (a, b) in zip(self.params, self.names, self.offsets):
            g = p.grad
            if self.hooked:
                if g is not None:
                    raise RuntimeError(
                        f"the .grad of {name!r} is set, but with grad_dtype {self.grad_dtype} the engine adds every "
                        "backward's gradient into its own buffer and leaves .grad None: something set it outside "
                        "backward (a gradient assigned by hand is not trained on: let backward produce it)")
                continue
            if g is None or g.data_ptr() != buf[a:b].data_ptr():
                raise RuntimeError(
                    f"the .grad of {name!r} was replaced or set to None outside the engine "
                    "(optimizer.zero_grad or model.zero_grad with set_to_none?): the engine owns "
                    "gradients; do not zero or replace them yourself")

    def shard(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        return tensor[rank * self.shard_size:(rank + 1) * self.shard_size]

    def matrices_in(self, rank: int) -> list[tuple[int, int, int]]:
        """The whole parameters (``matrices``) in shard ``rank``, their starts counted in it."""
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        return [(a - lo, rows, cols) for a, rows, cols in self.matrices if lo <= a < hi]

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """A padded buffer (``values``' dtype) with each parameter's values, given in model order
        as one vector, at its offset; zeros in the padding."""
        return _spread(self.offsets, self.padded, values)

    def install(self, values: torch.Tensor) -> None:
        """Make ``values`` (a whole padded buffer) the parameters the compute side runs on."""
        self.data.copy_(values)

    def read_into(self, out: torch.Tensor) -> torch.Tensor:
        """The parameters the compute side runs on, into ``out`` (a whole padded buffer)."""
        return out.copy_(self.data)


class LocalShards:
    """model_sharding='node' (engine/parallel/sharding.py): this rank's FSDP2 local shards of the trainable
    parameters as one padded flat buffer, the rail's exchange buffer, with FlatParams' interface.

    ``world_size`` is the rail's M (the ranks that share this cut); chunk m is rank (m, l)'s
    shard. Gradients work as in FlatParams: each parameter's ``.grad`` is a DTensor whose local
    tensor is a view of gradient buffer ``active``, and FSDP2 adds each micro-batch's reduced
    shard into it in place; a round reads the other buffer (one buffer without overlap: the
    round then gathers the new parameters into it, engine/parallel/sharding.py). Parameters are FSDP2's
    own storage and nothing else holds them (no ``data`` copy: FSDP2 pads each local shard to
    its own cut, so the shards cannot view one buffer): ``install`` copies the new local buffer
    into each local shard, ``read_into`` the shards into a buffer."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], world_size: int,
                 align: int, dtype: torch.dtype, grad_buffers: int = 2, whole: list[bool] | None = None):
        if not params:
            raise ValueError("the model has no trainable parameters (every requires_grad is False): "
                             "unfreeze at least one parameter")
        local = [p.to_local() for p in params]
        self.shapes = [t.shape for t in local]
        self.device, self.dtype, self.params, self.names = local[0].device, dtype, params, names
        self.world_size = world_size
        self.numel = sum(t.numel() for t in local)
        # (start, local rows, cols, whole rows) of each parameter an optimizer steps whole (Muon's)
        self.matrices: list[tuple[int, int, int, int]] = []
        if whole is not None and any(whole):
            self._place_whole(local, whole, align)
        else:
            unit = world_size * align
            self.padded = max(unit, -(-self.numel // unit) * unit)
            self.shard_size = self.padded // world_size
            self.offsets, offset = [], 0
            for t in local:
                self.offsets.append((offset, offset + t.numel()))
                offset += t.numel()
        self.grads = [torch.zeros(self.padded, dtype=dtype, device=self.device) for _ in range(grad_buffers)]
        self.active = 0
        self.point_grads(0)

    def _place_whole(self, local: list[torch.Tensor], whole: list[bool], align: int) -> None:
        """Muon under node sharding: every whole parameter's local rows in one chunk, the same
        chunk on every rail (engine/parallel/node_matrices.py gathers them inside the node).
        Each parameter gets a slot as long as the largest local rank's rows (local rank 0's:
        FSDP2 cuts dim 0 as torch.chunk does), so every rail computes the same places
        (acco_loco/matrix_layout.py); a shorter local shard leaves zeros after it."""
        g = self.params[0].device_mesh.size()
        slots = [-(-p.shape[0] // g) * (p.numel() // max(1, p.shape[0])) if p.dim() else p.numel()
                 for p in self.params]
        starts, self.shard_size = place(slots, whole, self.world_size, align)
        self.slots = slots  # what a re-cut places for another number of nodes (engine/checkpoint/recut_matrices.py)
        self.padded = self.shard_size * self.world_size
        self.offsets = [(a, a + t.numel()) for a, t in zip(starts, local)]
        self.matrices = sorted((a, t.shape[0], t.shape[1], p.shape[0])
                               for a, t, p, w in zip(starts, local, self.params, whole) if w)

    def matrices_in(self, chunk: int) -> list[tuple[int, int, int, int]]:
        """The whole parameters' local rows (``matrices``) in chunk ``chunk``, their starts counted in it."""
        lo, hi = chunk * self.shard_size, (chunk + 1) * self.shard_size
        return [(a - lo, *rest) for a, *rest in self.matrices if lo <= a < hi]

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """A padded local buffer (``values``' dtype) with each local shard, given in order as one
        vector, at its offset; zeros elsewhere."""
        return _spread(self.offsets, self.padded, values)

    def read_into(self, out: torch.Tensor) -> torch.Tensor:
        """The local shards, each at its offset, zeros between and after them, into ``out``."""
        with torch.no_grad():
            if self.matrices:
                out.zero_()  # slots longer than their shard (engine/parallel/node_matrices.py)
            out[self.numel:].zero_()
            for p, (a, b) in zip(self.params, self.offsets):
                out[a:b].copy_(p.to_local().reshape(-1))
        return out

    def point_grads(self, index: int) -> None:
        """Make every param's .grad a DTensor over a view of gradient buffer ``index``."""
        from torch.distributed.tensor import DTensor

        self.active = index
        buf = self.grads[index]
        for p, shape, (a, b) in zip(self.params, self.shapes, self.offsets):
            p.grad = DTensor.from_local(buf[a:b].view(shape), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())

    def check_grads_attached(self) -> None:
        """Raise if something replaced a .grad (zero_grad(set_to_none=True), or an FSDP2 that no
        longer adds into the gradient it finds)."""
        buf = self.grads[self.active]
        for p, name, (a, b) in zip(self.params, self.names, self.offsets):
            g = p.grad
            if g is None or (b > a and g.to_local().data_ptr() != buf[a:b].data_ptr()):
                raise RuntimeError(
                    f"the .grad of {name!r} was replaced or set to None outside the engine "
                    "(optimizer.zero_grad or model.zero_grad with set_to_none?): the engine owns "
                    "gradients; do not zero or replace them yourself")

    def shard(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Chunk ``rank`` of a local buffer (``rank``: this rank's node, its place on the rail)."""
        return tensor[rank * self.shard_size:(rank + 1) * self.shard_size]

    def install(self, values: torch.Tensor) -> None:
        """Copy the new local buffer into FSDP2's local shards (the compute side, at a boundary)."""
        with torch.no_grad():
            for p, (a, b) in zip(self.params, self.offsets):
                local = p.to_local()  # a view of FSDP2's sharded storage, fetched anew (it may re-pad it)
                local.copy_(values[a:b].view(local.shape))


def _spread(offsets, padded: int, values: torch.Tensor) -> torch.Tensor:
    """``values`` (the ranges' values one after another) at the ranges ``offsets`` of a zeroed
    buffer of ``padded`` values."""
    out = torch.zeros(padded, dtype=values.dtype, device=values.device)
    at = 0
    for a, b in offsets:
        out[a:b] = values[at:at + b - a]
        at += b - a
    return out
