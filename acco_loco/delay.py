"""Delay corrections for ACCO's stale half (docs/design/rounds.md, "delay corrections").

In an ACCO step (acco_loco/acco.py) the estimate half ``gtilde_t`` was accumulated on the
estimate ``thetatilde_t`` while the commit of ``theta_t`` was on the wire, and is then applied
at ``theta_t``. Both corrections below are options of the ``acco`` config section; at their
defaults (0) the step is ACCO as published (Nabli et al., arXiv 2406.02613).

* **Delay compensation** (Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay
  Compensation", ICML 2017, arXiv 1609.08326; DC-ASGD with a constant lambda): a first-order
  Taylor step of the gradient from the point it was computed at to the point it is applied at,
  with the diagonal ``lambda * g * g`` standing in for the Hessian:

      g(theta_t) ~ g(thetatilde_t) + lambda * g(thetatilde_t)**2 * (theta_t - thetatilde_t)

  applied to the mean stale gradient ``gtilde_t / ctilde``; on the reduced *sum* that is
  ``gtilde + lambda * gtilde**2 * drift / ctilde``.

* **Weight prediction** (the estimate point extrapolated along the optimizer's own last update,
  as PipeDream-2BW, Narayanan et al., arXiv 2006.09503, and SpecTrain, Chen et al., arXiv
  1809.02839, predict the weights a delayed gradient will be applied to): the estimate round
  sends ``theta_t + s * (theta_t - theta_{t-1})`` instead of ACCO's half-batch optimizer step,
  for a delay of ``s`` steps (the stale half is applied one step after the point it is
  computed at: s = 1).

Pure tensor math on one flat fp32 shard (or a slice of it): no process groups.
"""

from __future__ import annotations

import torch


def compensate_(stale_sum: torch.Tensor, count: int, drift: torch.Tensor, lam: float) -> torch.Tensor:
    """DC-ASGD's compensation of a gradient *sum* over ``count`` micro-batches, in place:
    ``stale_sum += lam * stale_sum**2 * drift / count`` (the mean's rule times ``count``).
    ``drift`` = (where it is applied) - (where it was computed). Returns ``stale_sum``."""
    if lam == 0.0 or count == 0:
        return stale_sum
    term = stale_sum * stale_sum
    term.mul_(drift).mul_(lam / count)
    return stale_sum.add_(term)


def predict_(out: torch.Tensor, master: torch.Tensor, last_update: torch.Tensor, steps: float) -> torch.Tensor:
    """Weight prediction, written into ``out``: ``master + steps * last_update``."""
    return torch.add(master, last_update, alpha=steps, out=out)
