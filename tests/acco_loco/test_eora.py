"""acco_loco.eora against float64 references on one random layer with an anisotropic input
covariance: the EoRA residual is the optimum of ||(dW - B A) X||_F among rank-r residuals,
beats plain SVD of dW in that norm, and recovers dW at full rank."""

from __future__ import annotations

import math

import pytest
import torch

from acco_loco.eora import (
    GramAccumulator,
    eigenbasis,
    eora_residual,
    svd_residual,
    weighted_error,
)

OUT, IN, TOKENS = 24, 32, 400


def _layer(seed: int = 0):
    """A weight error dW and inputs X (tokens as rows) whose covariance spans 4 decades."""
    g = torch.Generator().manual_seed(seed)
    dw = torch.randn(OUT, IN, generator=g, dtype=torch.float64)
    spread = torch.logspace(0, -4, IN, dtype=torch.float64)  # std per principal direction
    rot, _ = torch.linalg.qr(torch.randn(IN, IN, generator=g, dtype=torch.float64))
    x = (torch.randn(TOKENS, IN, generator=g, dtype=torch.float64) * spread) @ rot.T
    return dw, x


def _optimum(dw: torch.Tensor, gram: torch.Tensor, rank: int):
    """Closed form by another route: G = C C^T (Cholesky), best rank-r N of dW C, M = N C^-1.
    Returns (M, the minimal squared error = the tail of the squared singular values)."""
    c = torch.linalg.cholesky(gram)
    u, s, vh = torch.linalg.svd(dw @ c)
    n = (u[:, :rank] * s[:rank]) @ vh[:rank]
    m = torch.linalg.solve_triangular(c, n, upper=False, left=False)  # N C^-1
    return m, float((s[rank:] ** 2).sum())


@pytest.mark.parametrize("rank", [1, 4, 8, 16])
def test_eora_is_the_weighted_optimum_and_beats_svd(rank):
    dw, x = _layer()
    gram = x.T @ x
    basis = eigenbasis(gram, rel_floor=1e-12)  # well conditioned: nothing is clamped
    assert basis.clamped == 0
    eora = eora_residual(dw, basis, rank)
    b, a = eora.factors(rank, torch.float64)
    assert b.shape == (OUT, rank) and a.shape == (rank, IN)
    err = weighted_error(dw - b @ a, gram)
    best_m, best_err = _optimum(dw, gram, rank)
    assert err == pytest.approx(best_err, rel=1e-8)
    # the optimum is unique (distinct singular values): the same matrix, not just the same error
    torch.testing.assert_close(b @ a, best_m, rtol=1e-6, atol=1e-6 * float(best_m.abs().max()))
    # the direct definition ||(dW - BA) X||_F^2 agrees with the Gram form
    assert float(((dw - b @ a) @ x.T).pow(2).sum()) == pytest.approx(err, rel=1e-9)

    plain = svd_residual(dw, rank).product(rank)
    assert weighted_error(dw - plain, gram) > 1.5 * err  # SVD ignores which inputs occur
    # ... and no random rank-r perturbation of the optimum does better
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        db = 1e-3 * torch.randn(OUT, rank, generator=g, dtype=torch.float64)
        da = 1e-3 * torch.randn(rank, IN, generator=g, dtype=torch.float64)
        assert weighted_error(dw - (b + db) @ (a + da), gram) >= err * (1 - 1e-12)


def test_svd_residual_is_the_frobenius_optimum():
    dw, _ = _layer(1)
    s = torch.linalg.svdvals(dw)
    for rank in (1, 5, 12):
        b, a = svd_residual(dw, rank).factors(rank, torch.float64)
        assert float((dw - b @ a).pow(2).sum()) == pytest.approx(float((s[rank:] ** 2).sum()), rel=1e-9)


def test_full_rank_recovers_dw_even_with_clamped_eigenvalues():
    dw, _ = _layer(2)
    g = torch.Generator().manual_seed(2)
    # inputs confined to a 20-dimensional subspace: 12 eigenvalues are (numerically) zero
    x = torch.randn(TOKENS, 20, generator=g, dtype=torch.float64) @ torch.randn(
        20, IN, generator=g, dtype=torch.float64)
    gram = x.T @ x
    basis = eigenbasis(gram, rel_floor=1e-6)
    assert basis.clamped >= IN - 20
    assert float(basis.values.min()) == pytest.approx(basis.floor)
    eora = eora_residual(dw, basis, IN)
    torch.testing.assert_close(eora.product(IN), dw, rtol=0, atol=1e-7)
    b, a = eora.factors(IN, torch.float64)
    torch.testing.assert_close(b @ a, dw, rtol=0, atol=1e-7)
    # with a rank-deficient input the output error at rank 20 is (numerically) zero
    r20 = eora.product(20)
    assert weighted_error(dw - r20, gram) < 1e-10 * weighted_error(dw, gram)


def test_factors_pad_to_a_uniform_rank_and_nest():
    dw, x = _layer(3)
    res = eora_residual(dw[:6], eigenbasis(x.T @ x), 64)  # only 6 singular values exist
    assert res.max_rank == 6
    b, a = res.factors(8)
    assert b.shape == (6, 8) and a.shape == (8, IN) and b.dtype == torch.float32
    assert torch.all(b[:, 6:] == 0) and torch.all(a[6:] == 0)
    b4, a4 = res.factors(4, torch.float64)
    torch.testing.assert_close(b4 @ a4, res.product(4))  # a lower rank is a prefix


def test_gram_accumulator_and_input_checks():
    acc = GramAccumulator(IN)
    _, x = _layer(4)
    for chunk in x.float().reshape(4, -1, IN):  # batches of (tokens, in)
        acc.add(chunk[None])  # leading batch dims are flattened
    assert acc.rows == TOKENS
    ref = x.float().double().T @ x.float().double()
    torch.testing.assert_close(acc.gram, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="width"):
        acc.add(torch.zeros(3, IN + 1))
    with pytest.raises(ValueError, match="zero"):
        eigenbasis(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="NaN"):
        eigenbasis(torch.full((2, 2), math.nan))
    with pytest.raises(ValueError, match="input columns"):
        eora_residual(torch.zeros(3, 5), eigenbasis(torch.eye(4)), 2)
