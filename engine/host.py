"""The only places a round reads device values on the host. On a GPU each read waits for the
device (a host sync), so a round keeps them to what its control flow truly needs: the small
all-reduce's counts and flags, and whether the gathered parameters are finite. Everything else
(finiteness flags, weights, norms) stays on the device. tests/engine/test_host_syncs.py counts them."""

from __future__ import annotations

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Bring a small tensor to the host (one sync on a GPU)."""
    return t.cpu()


def nonfinite_rows(rows: torch.Tensor) -> list[int]:
    """Indices of the rows of a 2-D tensor that hold a NaN or an Inf: one host read when all
    are finite, one more to name the rows when some are not."""
    lo, hi = torch.aminmax(rows)
    if bool(to_host(torch.isfinite(torch.stack([lo, hi])).all())):
        return []
    finite = to_host(torch.isfinite(rows).all(dim=1))
    return [j for j in range(rows.shape[0]) if not bool(finite[j])]


def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """1.0 (a 0-d float64 tensor, on x's device) if x holds a NaN or an Inf, else 0.0; no host read."""
    lo, hi = torch.aminmax(x)
    return torch.isfinite(torch.stack([lo, hi])).all().logical_not().to(torch.float64)
