"""Where a local-step strategy keeps its outer state (theta_sync, the submitted snapshot, the outer
momentum or the error feedback; the ``outer_state_device`` setting, engine/strategies/outer_config.py)
and the copies between it and the inner parameters (docs/local_steps.md, "Node sharding and the
outer state on the CPU").

``device``: beside the inner parameters, as before. ``cpu``: in host memory, as INTELLECT-1 keeps
DiLoCo's outer state (Jaghouar et al., "INTELLECT-1 Technical Report", arXiv 2412.01152): the
accelerator then holds no outer state at all. What crosses between the two, per outer round: the
inner parameters to the host at submission (the snapshot the pseudo-gradient is formed from) and
the new theta_sync back at install, each copied in pieces of ``PIECE`` values, so no full-size
temporary is made on the accelerator; the collectives take the wire tensors on the compute device
(NCCL takes no host tensors), one wire-sized temporary at a time.
"""

from __future__ import annotations

import torch

PIECE = 1 << 22  # values per copy between the compute device and the host (16 MiB of fp32)


class OuterPlace:
    """The outer state's device and the piecewise copies to and from the inner parameters."""

    def __init__(self, setting: str, compute: torch.device):
        self.compute = compute
        self.device = torch.device("cpu") if setting == "cpu" else compute

    def copy_of(self, values: torch.Tensor) -> torch.Tensor:
        """A new fp32 tensor on the outer state's device holding ``values``."""
        out = torch.empty(values.numel(), dtype=torch.float32, device=self.device)
        self.copy(out, values)
        return out

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst = src`` piece by piece (dst and src may sit on different devices)."""
        with torch.no_grad():
            for a in range(0, src.numel(), PIECE):
                dst[a:a + PIECE].copy_(src[a:a + PIECE])

    def merge(self, inner: torch.Tensor, theta_sync: torch.Tensor, submitted: torch.Tensor) -> None:
        """The overlapped variant's merge, in place: ``inner += theta_sync - submitted`` (one piece
        of the difference on the compute device at a time)."""
        with torch.no_grad():
            for a in range(0, inner.numel(), PIECE):
                b = a + PIECE
                inner[a:b].add_((theta_sync[a:b] - submitted[a:b]).to(inner.device))

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the collectives take it (the compute device; no copy when it is there)."""
        return t.to(self.compute)

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        """A collective's result where the outer state lives."""
        return t.to(self.device)
