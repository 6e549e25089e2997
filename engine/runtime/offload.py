"""The sharded optimizer's state in host memory (``optimizer_offload='cpu'``).

The rank's fp32 master and moments (and the spare or piece-sized scratch a step is proposed into)
live in host memory, pinned when CUDA is present; the step runs on the CPU with the shard
optimizer's own step (acco_loco/optim.py ``propose_slice``: the fused CPU kernel where it is built,
torch's ops elsewhere), so its values are those of the run without offload on the same CPU. Per
round, piece by piece: the reduced gradient's piece goes to a host buffer, the piece is stepped
there, and its new master goes back through one of ``SCRATCH_SLOTS`` device staging slots a
piece long to the parameter gatherer. On CUDA the copies are asynchronous on the round's stream:
every piece's device-to-host copy is queued at once and the CPU steps piece k once its own copy
has landed (an event per piece), while pieces k + 1, ... are still copying; the host-to-device
copy of piece k runs while piece k + 1 is stepped. On a CPU-only machine host and device are the
same memory, and the copies are still made (separate tensors), so the path that runs is the one
a GPU runs.

What stays on the device: the staging slots (``SCRATCH_SLOTS`` x the longest piece, fp32), and a
shard-sized copy of the master only on the rare path where a step's new parameters overflow and
the unchanged master is gathered again. A strategy's own shard-long sums that only the step reads
live here too (``host_buffer``: ACCO's kept estimate half), added back into the device sum through
one staging piece (``add_from_host``).

The local-step strategies (diloco, sparseloco: engine/strategies/local_steps.py) use the same
``HostOptimizer`` for their inner optimizer: the gradient (the whole buffer, a node replica's slice
or the local shards) comes to the host in pieces, each piece is stepped once it has landed
(engine/strategies/inner_step.py, one piece-sized host scratch), and the new master goes back into
the compute parameters piece by piece (``send``). Where the step's norm was taken on the device (a
node replica's step: the node's all-reduce) the host keeps no full-size gradient copy, only
``GRAD_SLOTS`` piece-long slots the pieces take in turn (``gradient_pieces``). local_sgd's state is its replica's parameters
(``ctx.gather_buf``): ``HostParams`` keeps them in host memory and steps them there the same way.
"""

from __future__ import annotations

import os

import torch

from acco_loco.shard_state import SCRATCH_SLOTS, ShardState

OFFLOADS = ("none", "cpu")  # EngineConfig optimizer_offload
OFFLOAD_PIECE = 1 << 22  # values per host step and per device staging piece of a whole-buffer copy
GRAD_SLOTS = 2  # a local step's gradient pieces on the host at once: one stepped, the next copying


def pin_host() -> bool:
    """Whether host tensors are allocated pinned (page-locked, for asynchronous copies): with CUDA."""
    return torch.cuda.is_available()


def ask_for_cpu_kernels() -> None:
    """On a CUDA node the fused CPU kernels are not built by default (acco_loco/kernels.py): the
    offloaded step is theirs to run, so build them here, unless ACCO_LOCO_KERNELS turns them off
    (then torch's ops step the host tensors: the same values, more passes over memory)."""
    from acco_loco import kernels

    if os.environ.get("ACCO_LOCO_KERNELS", "").strip().lower() not in ("0", "off", "false", "no"):
        kernels.use(True)


def host_empty(n: int, pinned: bool) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float32, device="cpu", pin_memory=pinned)


def host_copy(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A host fp32 copy of ``t`` in memory of its own (never a view of ``t``)."""
    out = host_empty(t.numel(), pinned)
    out.copy_(t.detach().reshape(-1))
    return out


class HostOptimizer:
    """The offloaded state and the copies across. ``state`` (the context's ShardState) is rebound
    to host tensors here; what reads it afterwards reads host memory."""

    def __init__(self, state: ShardState, device: torch.device, whole_gradient: bool = True) -> None:
        """``whole_gradient`` False: no full-size host copy of the gradient; a step reads it through
        ``gradient_pieces`` (a local step whose norm was taken on the device)."""
        self.device = torch.device(device)
        self.pinned = pin_host()
        self.async_copies = self.device.type == "cuda"
        if self.async_copies:
            ask_for_cpu_kernels()
        sq = state.exp_avg_sq
        state.rebind(host_copy(state.master, self.pinned), host_copy(state.exp_avg, self.pinned),
                     None if sq is None else host_copy(sq, self.pinned), state.step)
        state.pinned = self.pinned  # its spare and scratch are allocated pinned too
        self.state = state
        n = state.master.numel()
        # the round's reduced gradient (a commit may step it twice), or GRAD_SLOTS piece-long slots
        self.grad = host_empty(n, self.pinned) if whole_gradient else None
        self.grad_slots: list[torch.Tensor] = []
        self.kernel_scratch: torch.Tensor | None = None  # the fused kernel's square roots, on the host
        self._staging: list[torch.Tensor] = []  # device: the new master's pieces on their way to the gatherer
        self._arrived: list = []  # CUDA: an event per piece of the gradient's copy to the host
        self._sent: list = [None] * SCRATCH_SLOTS  # CUDA: when each staging slot's source may be reused
        self.piece_scratch: torch.Tensor | None = None  # the piecewise inner step's square roots, on the host
        self.kept: dict[str, torch.Tensor] = {}  # a strategy's own host buffers (``host_buffer``)
        self._add_slot: torch.Tensor | None = None  # device: ``add_from_host``'s staging piece
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def host_buffer(self, name: str, n: int) -> torch.Tensor:
        """A host fp32 buffer ``n`` long kept under ``name`` for the run (pinned with CUDA)."""
        buf = self.kept.get(name)
        if buf is None or buf.numel() != n:
            buf = self.kept[name] = host_empty(n, self.pinned)
        return buf

    def keep_on_host(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """``src`` (a device shard) copied into host buffer ``name``, waited for: returned."""
        out = self.host_buffer(name, src.numel())
        out.copy_(src.detach().reshape(-1))
        self.bytes_to_host += 4 * src.numel()
        return out

    def add_from_host(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst += src`` (``src`` in host memory) a piece at a time through one device staging piece:
        elementwise, so the bits of the whole-buffer add; no shard-sized device temporary."""
        with torch.no_grad():
            for a, b in pieces_of(src.numel(), OFFLOAD_PIECE):
                if self._add_slot is None:
                    self._add_slot = torch.empty(min(src.numel(), OFFLOAD_PIECE), dtype=torch.float32,
                                                 device=self.device)
                part = self._add_slot[:b - a]
                part.copy_(src[a:b])  # one stream: the add reads the slot before the next copy writes it
                dst[a:b].add_(part)
        self.bytes_to_device += 4 * src.numel()
        return dst

    # ---------------------------------------------------------------- device -> host
    def fetch_gradient(self, step_sum: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
        """Start copying the reduced gradient to the host buffer, piece by piece; ``wait(k)``
        before reading piece k. Returns the host buffer (shard indices, as ``step_sum``)."""
        if self.grad is None:
            raise RuntimeError("this offload keeps no whole host copy of the gradient (whole_gradient=False): "
                               "read it through gradient_pieces")
        if step_sum.numel() != self.grad.numel():
            raise ValueError(f"gradient shard of {step_sum.numel()} values, host state of {self.grad.numel()}")
        self._arrived = []
        for a, b in pieces:
            self.grad[a:b].copy_(step_sum[a:b], non_blocking=self.async_copies)
            if self.async_copies:
                event = torch.cuda.Event()
                event.record()
                self._arrived.append(event)
            self.bytes_to_host += 4 * (b - a)
        return self.grad

    def gradient_pieces(self, step_sum: torch.Tensor, pieces: list[tuple[int, int]]):
        """The gradient's host copy in GRAD_SLOTS piece-long slots taken in turn: returns
        ``ready(k)``, piece k's values on the host (a slot's view), to be called for k = 0, 1, ...
        and each piece read before the next call. Piece k goes into slot k % GRAD_SLOTS once piece
        k - GRAD_SLOTS has been read; on CUDA the copies run ahead, asynchronously, one slot beyond
        the piece being stepped."""
        if step_sum.numel() != self.state.master.numel():
            raise ValueError(f"gradient of {step_sum.numel()} values, host state of {self.state.master.numel()}")
        width = max((b - a for a, b in pieces), default=0)
        slots = min(GRAD_SLOTS, len(pieces))
        for i in range(slots):
            if i == len(self.grad_slots):
                self.grad_slots.append(host_empty(width, self.pinned))
            elif self.grad_slots[i].numel() < width:
                self.grad_slots[i] = host_empty(width, self.pinned)
        arrived: list = []
        copying = [0]  # the pieces whose copy has been started

        def ready(k: int) -> torch.Tensor:
            while copying[0] < min(len(pieces), k + GRAD_SLOTS):  # piece k - 1 is read: its slot is free
                j = copying[0]
                a, b = pieces[j]
                self.grad_slots[j % GRAD_SLOTS][:b - a].copy_(step_sum[a:b], non_blocking=self.async_copies)
                if self.async_copies:
                    event = torch.cuda.Event()
                    event.record()
                    arrived.append(event)
                self.bytes_to_host += 4 * (b - a)
                copying[0] += 1
            if arrived:
                arrived[k].synchronize()
            a, b = pieces[k]
            return self.grad_slots[k % GRAD_SLOTS][:b - a]

        return ready

    def wait(self, k: int) -> None:
        """Piece k of the gradient is in host memory."""
        if self._arrived:
            self._arrived[k].synchronize()

    def fetch_all(self, step_sum: torch.Tensor, piece: int) -> torch.Tensor:
        """The whole gradient in the host buffer (what reads it all at once: a norm on the host)."""
        host = self.fetch_gradient(step_sum, pieces_of(step_sum.numel(), piece))
        if self._arrived:
            self._arrived[-1].synchronize()  # one stream: the last copy's event follows every other
        return host

    def host_piece_scratch(self, width: int) -> torch.Tensor:
        """A host fp32 scratch ``width`` long (the piecewise inner step's), kept between steps."""
        if self.piece_scratch is None or self.piece_scratch.numel() < width:
            self.piece_scratch = host_empty(width, self.pinned)
        return self.piece_scratch

    def send(self, dst: torch.Tensor, src: torch.Tensor, piece: int) -> None:
        """``dst = src`` (device <- host, any dtype) piece by piece: no full-size device temporary."""
        send_pieces(self, dst, src, piece)

    # ---------------------------------------------------------------- host -> device
    def staged(self, k: int, source: torch.Tensor, width: int) -> torch.Tensor:
        """``source`` (a piece's new master, on the host) copied into device staging slot
        k % SCRATCH_SLOTS: what the gatherer sends. The gatherer reads a slot until the push of
        piece k + 2 has drained it (engine/parallel/collectives.py), so three slots are enough."""
        slot = k % SCRATCH_SLOTS
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(width, dtype=torch.float32, device=self.device))
        if self._staging[slot].numel() < width:
            self._staging[slot] = torch.empty(width, dtype=torch.float32, device=self.device)
        n = source.numel()
        out = self._staging[slot][:n]
        out.copy_(source, non_blocking=self.async_copies)
        if self.async_copies:  # the host slot that was copied from must not be rewritten before this
            event = torch.cuda.Event()
            event.record()
            self._sent[slot] = event
        self.bytes_to_device += 4 * n
        return out

    def before_writing(self, k: int) -> None:
        """The host scratch slot piece k is proposed into was last copied out by piece k - 3:
        on CUDA wait for that copy (on the CPU copies are done when they return)."""
        event = self._sent[k % SCRATCH_SLOTS]
        if event is not None:
            event.synchronize()

    def device_master(self) -> torch.Tensor:
        """The whole master on the device (a temporary: the rare regather after an overflow)."""
        return self.state.master.to(self.device, copy=True)

    def host_kernel_scratch(self) -> torch.Tensor:
        n = self.state.master.numel()
        if self.kernel_scratch is None or self.kernel_scratch.numel() != n:
            self.kernel_scratch = host_empty(n, self.pinned)
        return self.kernel_scratch

    def host_tensors(self) -> list[torch.Tensor]:
        """Every tensor this offload keeps in host memory (for the memory accounting)."""
        out = ([self.grad] if self.grad is not None else []) + self.grad_slots + list(self.state.tensors().values())
        spare, scratch = self.state._spare, self.state._scratch
        if spare is not None:
            out += list(spare.tensors().values())
        if scratch is not None:
            masters, m, v = scratch
            out += masters + [m] + ([v] if v is not None else [])
        out += [t for t in (self.kernel_scratch, self.piece_scratch) if t is not None] + list(self.kept.values())
        return out

    def device_tensors(self) -> list[torch.Tensor]:
        return list(self._staging) + ([self._add_slot] if self._add_slot is not None else [])


def pieces_of(n: int, piece: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + piece)) for a in range(0, n, piece)]


def send_pieces(offload, dst: torch.Tensor, src: torch.Tensor, piece: int) -> None:
    """``dst = src`` from host memory to the device, piece by piece, counting the bytes. On CUDA the
    copies are queued asynchronously (pinned memory) and waited for once at the end."""
    with torch.no_grad():
        for a, b in pieces_of(src.numel(), piece):
            dst[a:b].copy_(src[a:b], non_blocking=offload.async_copies)
    if offload.async_copies:  # the host source may be rewritten next (a round's theta_sync, a merge): done first
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
    offload.bytes_to_device += src.numel() * src.element_size()


class HostParams:
    """local_sgd with ``optimizer_offload='cpu'``: its state, the replica's parameters
    (``ctx.gather_buf``, in the compute dtype), in host memory. Its round steps them there piece by
    piece (the gradient's piece copied to the host first), the period's average runs on host tensors
    (gloo) or piecewise through a device staging piece (NCCL takes device tensors), and the loop
    installs them into the compute parameters from the host."""

    def __init__(self, values: torch.Tensor, device: torch.device, piece: int) -> None:
        self.device = torch.device(device)
        self.pinned = pin_host()
        self.async_copies = self.device.type == "cuda"
        self.piece = piece
        self.values = torch.empty(values.numel(), dtype=values.dtype, device="cpu", pin_memory=self.pinned)
        self.values.copy_(values)
        self.grad = torch.empty(min(values.numel(), piece), dtype=values.dtype, device="cpu", pin_memory=self.pinned)
        self._staging: torch.Tensor | None = None  # device: NCCL's piece of the average
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def sgd_step(self, grad_sum: torch.Tensor, count: int, lr: float) -> None:
        """``values -= lr * grad_sum / count``, a piece at a time on the host (the same elementwise
        operations as the step on the device, so the same bits on the same CPU)."""
        for a, b in pieces_of(self.values.numel(), self.piece):
            g = self.grad[:b - a]
            g.copy_(grad_sum[a:b])  # synchronous: read at once
            self.bytes_to_host += g.numel() * g.element_size()
            self.values[a:b].add_(g / count, alpha=-lr)

    def average(self, comm) -> None:
        """The period's mean of every replica's ``values`` over ``comm``."""
        if self.device.type == "cpu":  # host tensors go to gloo as they are
            comm.all_reduce_sum(self.values).div_(comm.world_size)
            return
        for a, b in pieces_of(self.values.numel(), self.piece):
            if self._staging is None:
                self._staging = torch.empty(min(self.values.numel(), self.piece), dtype=self.values.dtype,
                                            device=self.device)
            part = self._staging[:b - a]
            part.copy_(self.values[a:b])
            comm.all_reduce_sum(part).div_(comm.world_size)
            self.values[a:b].copy_(part)

    def host_tensors(self) -> list[torch.Tensor]:
        return [self.values, self.grad]

    def device_tensors(self) -> list[torch.Tensor]:
        return [] if self._staging is None else [self._staging]
