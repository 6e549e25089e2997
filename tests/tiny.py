"""A tiny model, data streams and a float64 sequential reference of every strategy."""

from __future__ import annotations

import copy

import torch

IN, HIDDEN, OUT = 6, 16, 3


def tiny_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    return model.to(dtype)


def mse_loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def worker_stream(rank: int, n: int, batch: int = 4, seed: int = 0, dtype=torch.float32):
    """Worker ``rank``'s micro-batches: a pure function of (seed, rank, index)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    w = torch.Generator().manual_seed(seed)
    target = torch.randn(IN, OUT, generator=w)
    out = []
    for _ in range(n):
        x = torch.randn(batch, IN, generator=g)
        y = torch.tanh(x @ target) + 0.1 * torch.randn(batch, OUT, generator=g)
        out.append((x.to(dtype), y.to(dtype)))
    return out


def flat_params(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector([p for p in model.parameters() if p.requires_grad]).detach().clone()


class MuonAdamW:
    """torch.optim.Muon on the model's 2-D weights and torch.optim.AdamW on the rest (the engine's
    optimizer='muon' split for a model without embeddings), stepping one flat vector ``theta``."""

    def __init__(self, theta: torch.Tensor, model, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999),
                 eps: float = 1e-8, momentum: float = 0.95, nesterov: bool = True,
                 adjust_lr_fn: str = "match_rms_adamw"):
        self.theta = theta
        self.pieces, self.bounds, at = [], [], 0
        for p in model.parameters():
            self.pieces.append(torch.zeros(p.shape, dtype=theta.dtype, requires_grad=True))
            self.bounds.append((at, at + p.numel()))
            at += p.numel()
        matrices = [q for q in self.pieces if q.ndim == 2]
        rest = [q for q in self.pieces if q.ndim != 2]
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def step(self) -> None:
        with torch.no_grad():
            for q, (a, b) in zip(self.pieces, self.bounds):
                q.copy_(self.theta[a:b].view(q.shape))
                q.grad = self.theta.grad[a:b].view(q.shape).clone()
            self.muon.step()
            self.adamw.step()
            for q, (a, b) in zip(self.pieces, self.bounds):
                self.theta[a:b].copy_(q.view(-1))

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


class Reference:
    """Float64, no threads, no process group: each strategy's equations written out.

    ``streams[w]`` is worker w's micro-batch list; round r of worker w uses its micro-batches
    [r*k, (r+1)*k). The optimizer is torch.optim.AdamW/SGD on one float64 flat vector (or Muon +
    AdamW on its pieces: ``MuonAdamW``); ACCO's
    estimate step runs on a deep copy of the optimizer, which is thrown away.
    """

    def __init__(self, model, streams, k: int, opt: str = "adamw", lr: float = 1e-2,
                 round_counts: list[list[int]] | None = None, **opt_kwargs):
        self.model = copy.deepcopy(model).to(torch.float64)
        self.streams = [[(x.double(), y.double()) for x, y in s] for s in streams]
        self.k = k
        self.theta = flat_params(self.model).double().requires_grad_(True)
        if opt == "muon":
            self.opt = MuonAdamW(self.theta, self.model, lr=lr, **opt_kwargs)
        else:
            cls = torch.optim.AdamW if opt == "adamw" else torch.optim.SGD
            self.opt = cls([self.theta], lr=lr, **opt_kwargs)
        self.round = 0
        # adaptive runs: round_counts[w][r] micro-batches of worker w in round r
        self.round_counts = round_counts
        self.cursor = [0] * len(streams)

    def grads(self, theta: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Sum over workers and this round's micro-batches of the gradient at ``theta``."""
        total = torch.zeros_like(self.theta)
        count = 0
        params = [p for p in self.model.parameters()]
        torch.nn.utils.vector_to_parameters(theta.detach(), params)
        for w, stream in enumerate(self.streams):
            if self.round_counts is None:
                n = self.k
            else:  # a round the engine accumulated but never submitted contributes nothing
                n = self.round_counts[w][self.round] if self.round < len(self.round_counts[w]) else 0
            start, self.cursor[w] = self.cursor[w], self.cursor[w] + n
            for x, y in stream[start:start + n]:
                self.model.zero_grad()
                mse_loss(self.model, (x, y)).backward()
                total += torch.nn.utils.parameters_to_vector([p.grad for p in params])
                count += 1
        self.round += 1
        return total, count

    def _step(self, opt, theta_grad: torch.Tensor) -> None:
        self.theta.grad = theta_grad
        opt.step()

    def apply(self, grad: torch.Tensor, count: int) -> None:
        with torch.no_grad():
            self._step(self.opt, grad / count)

    def estimate(self, grad: torch.Tensor, count: int) -> torch.Tensor:
        saved = self.theta.detach().clone()
        state = copy.deepcopy(self.opt.state_dict())
        with torch.no_grad():
            self._step(self.opt, grad / count)
            out = self.theta.detach().clone()
            self.theta.copy_(saved)
        self.opt.load_state_dict(state)
        return out

    def run(self, strategy: str, steps: int) -> list[torch.Tensor]:
        """Committed parameters after each step."""
        out = []
        if strategy == "zero1":
            for _ in range(steps):
                g, c = self.grads(self.theta)
                self.apply(g, c)
                out.append(self.theta.detach().clone())
        elif strategy == "dpu":
            compute_on = self.theta.detach().clone()
            g, c = self.grads(compute_on)
            for _ in range(steps):
                # the compute side runs the next round on the params it holds, before install
                g_next, c_next = self.grads(compute_on)
                self.apply(g, c)
                compute_on = self.theta.detach().clone()
                g, c = g_next, c_next
                out.append(self.theta.detach().clone())
        elif strategy == "acco":
            gt, ct = self.grads(self.theta)  # gtilde_0 on theta_0
            for _ in range(steps):
                theta_tilde = self.estimate(gt, ct)
                g, c = self.grads(self.theta)  # g_t on theta_t, beside the estimate round
                gt_next, ct_next = self.grads(theta_tilde)  # gtilde_{t+1}, beside the commit round
                self.apply(gt + g, ct + c)
                gt, ct = gt_next, ct_next
                out.append(self.theta.detach().clone())
        else:
            raise ValueError(strategy)
        return out


def mean_grad_f64(model, theta: torch.Tensor, batches) -> torch.Tensor:
    """The mean micro-batch gradient of a float64 model at ``theta`` (a flat vector)."""
    params = list(model.parameters())
    torch.nn.utils.vector_to_parameters(theta, params)
    total = torch.zeros_like(theta)
    for x, y in batches:
        model.zero_grad()
        mse_loss(model, (x.double(), y.double())).backward()
        total += torch.nn.utils.parameters_to_vector([p.grad for p in params])
    return total / len(batches)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
