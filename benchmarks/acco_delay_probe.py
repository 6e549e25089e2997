"""How wrong ACCO's stale half is, and how much each delay correction could fix (docs/acco_delay.md).

One process, no communication: ACCO's schedule (acco_loco/acco.py) on the benchmark's model and
data (benchmarks/worker.py), each half ``--half`` micro-batches of ``--micro-batch`` sequences,
the shard optimizer of the engine (acco_loco/optim.py, AdamW 0.9/0.999, no weight decay), the
benchmark's warmup (``--warmup`` steps) at ``--lr``, no clipping. Per step it prints

* ``dg/g``: |g_B(theta_t) - g_B(thetatilde_t)| / |g_B(thetatilde_t)|, the stale half's error
  (its own batch B, at the point it is applied vs the point it was computed at);
* ``lam*``: the least-squares lambda of DC-ASGD's term ``lam * g*g*(theta_t - thetatilde_t)``
  against that error, and ``resid`` = |error - lam* term| / |error| (1: the term explains none
  of it);
* ``acco_est`` / ``wp_est``: |theta_{t+1} - estimate| / |theta_{t+1} - theta_t| for ACCO's
  half-batch estimate and for weight prediction's ``theta_t + (theta_t - theta_{t-1})``.

    python benchmarks/acco_delay_probe.py --steps 14
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from acco_loco.optim import OptimizerSpec, init_state, propose_step  # noqa: E402
from acco_loco.schedule import lr_at  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10, help="linear warmup steps (the benchmark's 5%% of 192)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--half", type=int, default=2, help="micro-batches per half (B = 16: 2 of 4)")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from benchmarks.worker import build_data, build_model
    from lm.data import hf_lm_loss

    spec = {"seq_len": a.seq_len, "micro_batch": a.micro_batch, "heldout": "hamlet", "eval_batches": 1,
            "seed": a.seed, "n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head}
    tok, stream, _ = build_data(spec, 0, 1)
    model = build_model(spec, len(tok))
    params = [p for p in model.parameters() if p.requires_grad]

    def grad_at(theta: torch.Tensor, batches) -> torch.Tensor:
        torch.nn.utils.vector_to_parameters(theta, params)
        total = torch.zeros_like(theta)
        for b in batches:
            model.zero_grad()
            hf_lm_loss(model, b).backward()
            total += torch.nn.utils.parameters_to_vector([p.grad for p in params])
        return total / len(batches)

    opt = OptimizerSpec("adamw", weight_decay=0.0)
    state = init_state(torch.nn.utils.parameters_to_vector(params).detach(), opt)
    batches = stream.iter_from(0)
    take = lambda: [next(batches) for _ in range(a.half)]  # noqa: E731
    point, stale_batch = state.master.clone(), take()
    stale = grad_at(point, stale_batch)
    last_update = torch.zeros_like(point)
    for t in range(a.steps):
        theta = state.master.clone()
        lr = lr_at(t, a.lr, "constant", a.warmup, a.steps, 0.0)
        line = f"step {t}:"
        if t > 0:
            error = grad_at(theta, stale_batch) - stale
            term = stale * stale * (theta - point)
            lam = float(error @ term / (term @ term))
            line += (f" dg/g={error.norm() / stale.norm():.3f} lam*={lam:.3g}"
                     f" resid={(error - lam * term).norm() / error.norm():.3f}")
        estimate = propose_step(state, stale, lr, opt).master
        fresh = grad_at(theta, take())
        next_batch = take()
        next_stale = grad_at(estimate, next_batch)
        state.install(propose_step(state, (stale + fresh) / 2, lr, opt))
        update = state.master - theta
        if t > 0:
            line += (f" acco_est={(state.master - estimate).norm() / update.norm():.3f}"
                     f" wp_est={(update - last_update).norm() / update.norm():.3f}")
        print(line, flush=True)
        point, stale, stale_batch, last_update = estimate, next_stale, next_batch, update
    return 0


if __name__ == "__main__":
    sys.exit(main())
