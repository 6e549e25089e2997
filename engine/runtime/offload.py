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
the unchanged master is gathered again.
"""

from __future__ import annotations

import os

import torch

from acco_loco.shard_state import SCRATCH_SLOTS, ShardState

OFFLOADS = ("none", "cpu")  # EngineConfig optimizer_offload


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

    def __init__(self, state: ShardState, device: torch.device) -> None:
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
        self.grad = host_empty(n, self.pinned)  # the round's reduced gradient (a commit may step it twice)
        self.kernel_scratch: torch.Tensor | None = None  # the fused kernel's square roots, on the host
        self._staging: list[torch.Tensor] = []  # device: the new master's pieces on their way to the gatherer
        self._arrived: list = []  # CUDA: an event per piece of the gradient's copy to the host
        self._sent: list = [None] * SCRATCH_SLOTS  # CUDA: when each staging slot's source may be reused
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    # ---------------------------------------------------------------- device -> host
    def fetch_gradient(self, step_sum: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
        """Start copying the reduced gradient to the host buffer, piece by piece; ``wait(k)``
        before reading piece k. Returns the host buffer (shard indices, as ``step_sum``)."""
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

    def wait(self, k: int) -> None:
        """Piece k of the gradient is in host memory."""
        if self._arrived:
            self._arrived[k].synchronize()

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
        if self.kernel_scratch is None or self.kernel_scratch.numel() != self.grad.numel():
            self.kernel_scratch = host_empty(self.grad.numel(), self.pinned)
        return self.kernel_scratch

    def host_tensors(self) -> list[torch.Tensor]:
        """Every tensor this offload keeps in host memory (for the memory accounting)."""
        out = [self.grad] + list(self.state.tensors().values())
        spare, scratch = self.state._spare, self.state._scratch
        if spare is not None:
            out += list(spare.tensors().values())
        if scratch is not None:
            masters, m, v = scratch
            out += masters + [m] + ([v] if v is not None else [])
        if self.kernel_scratch is not None:
            out.append(self.kernel_scratch)
        return out

    def device_tensors(self) -> list[torch.Tensor]:
        return list(self._staging)
