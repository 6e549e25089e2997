"""Low-rank compensation of a weight error, weighted by the layer's inputs (EoRA), and the plain
SVD baseline.

A compressed linear layer ``W_hat`` of ``W`` (shape ``(out, in)``) is corrected by a rank-``r``
path ``B A`` (``B``: ``(out, r)``, ``A``: ``(r, in)``), so that ``y = W_hat x + B (A x)``.
What matters is the output error on real inputs: with calibration inputs ``X`` (``(in, n)``,
one column per token) and ``dW = W - W_hat``, minimize ``||(dW - B A) X||_F``.

EoRA (Liu et al., "EoRA: Training-free Compensation for Compressed LLM with Eigenspace
Low-Rank Approximation", arXiv:2410.21271) does this in the eigenspace of the input Gram
matrix ``G = X X^T = Q L Q^T``:

    dW' = dW Q sqrt(L)                      (project and scale)
    dW' ~ U_r S_r V_r^T                      (truncated SVD, Eckart-Young)
    B A = U_r S_r V_r^T sqrt(L)^-1 Q^T       (project back)

Why it is optimal: ``||Y X||_F^2 = tr(Y G Y^T) = ||Y Q sqrt(L)||_F^2``, so with an invertible
``Q sqrt(L)`` the problem is plain low-rank approximation of ``dW Q sqrt(L)``, whose best
rank-``r`` answer is the truncated SVD. Plain SVD of ``dW`` (the ablation) minimizes
``||dW - B A||_F`` instead, which treats every input direction as equally likely.

Tiny or zero eigenvalues (directions the calibration data never excites, or round-off below
zero) are clamped up to ``rel_floor * max(L)`` rather than dropped: ``Q sqrt(L)`` then stays
invertible, the full-rank residual is exactly ``dW``, and those directions carry a small
weight so the truncation spends no rank on them. Clamping changes the objective only along
directions whose energy is below the floor.

The factors are split evenly, ``B = U_r sqrt(S_r)`` and ``A = sqrt(S_r) V_r^T sqrt(L)^-1 Q^T``,
which keeps both at similar magnitudes (they are stored as a LoRA adapter, possibly in
float16). The SVD of one layer serves every rank up to its maximum: a rank-``r`` truncation is
a prefix of the rank-``R`` one.

Pure float64 tensor math, no modules or hooks; ``lm/calibration.py`` collects the Gram
matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Eigenbasis",
    "GramAccumulator",
    "LowRankResidual",
    "eigenbasis",
    "eora_residual",
    "svd_residual",
    "weighted_error",
]


class GramAccumulator:
    """Running ``sum_t x_t x_t^T`` over input rows ``x_t`` (float64), and the row count."""

    def __init__(self, dim: int):
        self.gram = torch.zeros(dim, dim, dtype=torch.float64)
        self.rows = 0

    def add(self, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        if x.shape[-1] != self.gram.shape[0]:
            raise ValueError(f"inputs of width {x.shape[-1]} for a Gram matrix of width {self.gram.shape[0]}")
        # the product in the input's precision (fast), the running sum in float64 (many batches)
        x32 = x.to(torch.float32)
        self.gram += (x32.T @ x32).to(torch.float64)
        self.rows += x.shape[0]


@dataclass(frozen=True)
class Eigenbasis:
    """``G = Q diag(values) Q^T`` with the eigenvalues clamped from below at ``floor``."""

    vectors: Tensor  # Q, (d, d) float64, orthonormal columns
    values: Tensor  # clamped eigenvalues, (d,) float64, ascending
    floor: float
    clamped: int  # how many eigenvalues were raised to the floor


def eigenbasis(gram: Tensor, rel_floor: float = 1e-6) -> Eigenbasis:
    """Eigen-decomposition of a (symmetric, positive semi-definite) Gram matrix, clamped."""
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"the Gram matrix must be square, got shape {tuple(gram.shape)}")
    if not 0.0 < rel_floor < 1.0:
        raise ValueError(f"rel_floor must be in (0, 1), got {rel_floor}")
    g = gram.to(torch.float64)
    if not torch.isfinite(g).all():
        raise ValueError("the Gram matrix has NaN/Inf entries: calibration activations overflowed")
    values, vectors = torch.linalg.eigh((g + g.T) / 2)
    top = float(values.max())
    if top <= 0.0:
        raise ValueError("the Gram matrix is zero: the layer saw no (non-zero) calibration input")
    floor = rel_floor * top
    return Eigenbasis(vectors, values.clamp(min=floor), floor, int((values < floor).sum()))


@dataclass(frozen=True)
class LowRankResidual:
    """A truncated SVD ``dW ~ U diag(S) Vb`` kept up to its largest rank; :meth:`factors`
    slices any smaller rank. ``Vb`` already includes the projection back to input space."""

    u: Tensor  # (out, R)
    s: Tensor  # (R,), descending
    vb: Tensor  # (R, in)

    @property
    def max_rank(self) -> int:
        return int(self.s.numel())

    def factors(self, rank: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """``(B, A)`` at ``rank``; zero-padded when the layer has fewer singular values, so
        every layer of an adapter gets the same rank."""
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        k = min(rank, self.max_rank)
        root = self.s[:k].sqrt()
        b = self.u[:, :k] * root
        a = root[:, None] * self.vb[:k]
        if k < rank:
            b = torch.nn.functional.pad(b, (0, rank - k))
            a = torch.nn.functional.pad(a, (0, 0, 0, rank - k))
        return b.to(dtype).contiguous(), a.to(dtype).contiguous()

    def product(self, rank: int) -> Tensor:
        """``B A`` at ``rank``, float64."""
        k = min(rank, self.max_rank)
        return (self.u[:, :k] * self.s[:k]) @ self.vb[:k]


def _truncated_svd(m: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    k = min(rank, s.numel())
    return u[:, :k], s[:k], vh[:k]


def svd_residual(dw: Tensor, max_rank: int) -> LowRankResidual:
    """Plain truncated SVD of ``dW``: best in ``||dW - B A||_F``, blind to the inputs."""
    u, s, vh = _truncated_svd(dw.to(torch.float64), max_rank)
    return LowRankResidual(u, s, vh)


def eora_residual(dw: Tensor, basis: Eigenbasis, max_rank: int) -> LowRankResidual:
    """EoRA: best rank-``r`` residual in ``||(dW - B A) X||_F`` (for the clamped spectrum)."""
    dw = dw.to(torch.float64)
    if dw.shape[1] != basis.vectors.shape[0]:
        raise ValueError(f"dW has {dw.shape[1]} input columns, the eigenbasis {basis.vectors.shape[0]}")
    root = basis.values.sqrt()
    u, s, vh = _truncated_svd((dw @ basis.vectors) * root, max_rank)  # dW Q sqrt(L)
    back = (vh / root) @ basis.vectors.T  # V^T sqrt(L)^-1 Q^T
    return LowRankResidual(u, s, back)


def weighted_error(residual: Tensor, gram: Tensor) -> float:
    """``||E X||_F^2 = tr(E G E^T)`` for an ``(out, in)`` error ``E``."""
    e = residual.to(torch.float64)
    return float(((e @ gram.to(torch.float64)) * e).sum())
