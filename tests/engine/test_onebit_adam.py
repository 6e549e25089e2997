"""onebit_adam (engine/strategies/onebit_adam.py, docs/onebit_adam.md) in gloo groups of 2
and 3 and at world 1 against a float64 sequential reference of AdamW warmup + compressed steps:
replicas bit-identical, bytes per compressed step (the formula, at most 1/25 of fp32 zero1's),
the unused-parameter mask, clipping, bf16 compute, the freeze rule, bit-exact resume across the
warmup boundary, non-finite steps and refused configurations."""

from __future__ import annotations

import copy
import functools
import itertools
import math
import re
import tempfile

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core.rounds import NonFiniteGradientError
from engine.parallel.local_group import spawn
from engine.strategies.onebit_adam import compressed_step_bytes
from tests.tiny import HIDDEN, IN, flat_params, mean_grad_f64, mse_loss, rel_err, tiny_model, worker_stream

K, LR, WD, WARMUP, STEPS, G = 2, 1e-2, 0.1, 3, 8, 8
BETAS, EPS = (0.9, 0.999), 1e-8
NUMEL = sum(p.numel() for p in tiny_model(0).parameters())


def padded(world: int) -> int:
    return -(-NUMEL // (G * world)) * G * world


def config(**kw) -> EngineConfig:
    base = dict(strategy="onebit_adam", lr=LR, weight_decay=WD, micro_batches=K, max_steps=STEPS, align=8,
                group_size=G, onebit_warmup_steps=WARMUP)
    return EngineConfig(**{**base, **kw})


def data_dtype(kw: dict) -> torch.dtype:
    return torch.bfloat16 if kw.get("compute_dtype") == "bfloat16" else torch.float32


def train(rank: int, kw: dict, model=None) -> dict:
    """Parameters after every step, the history and the strategy's state at the end."""
    engine = Engine(model if model is not None else tiny_model(0), config(**kw), mse_loss)
    it = iter(worker_stream(rank, K * (STEPS + 1), dtype=data_dtype(kw)))
    params, history = [], []
    for _ in range(STEPS):
        history += engine.fit(it, steps=1)
        params.append(flat_params(engine.model).float())
    st = engine.strategy.state
    out = {"params": params, "history": history, "frozen_step": st.frozen_step, "momentum": st.momentum.clone(),
           "worker_error": st.worker_error.clone(), "mask": st.mask.clone(), "gather_buf": engine.ctx.gather_buf.clone(),
           "master": None if st.master is None else st.master.clone()}
    engine.close()
    return out


# ------------------------------------------------------------------------------ the reference
def sign_rms(h: torch.Tensor) -> torch.Tensor:
    """deQ(Q(h)) of sign1 in float64: per group of G, sign(h) (sign(0) = +1) x sqrt(mean(h^2))."""
    hg = h.view(-1, G)
    return (torch.where(hg >= 0, 1.0, -1.0) * hg.square().mean(dim=1, keepdim=True).sqrt()).view(-1)


class OnebitReference:
    """Float64, sequential: torch.optim.AdamW on the mean gradient for WARMUP steps, then the
    equations of section 9 with every worker's momentum, error and the server error written out."""

    def __init__(self, world: int, max_norm: float | None = None, warmup: int = WARMUP):
        self.model = copy.deepcopy(tiny_model(0)).double()
        self.world, self.max_norm, self.warmup, self.size = world, max_norm, warmup, padded(world)
        theta = torch.zeros(self.size, dtype=torch.float64)
        theta[:NUMEL] = flat_params(self.model)
        self.theta = theta.requires_grad_(True)
        self.opt = torch.optim.AdamW([self.theta], lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
        self.streams = [worker_stream(w, K * (STEPS + 1)) for w in range(world)]
        self.t = 0
        self.bounds: list[float] = []

    def sums(self) -> list[torch.Tensor]:
        """Every worker's gradient sum over its K micro-batches of this step, padded."""
        out = []
        for stream in self.streams:
            x = torch.zeros(self.size, dtype=torch.float64)
            x[:NUMEL] = K * mean_grad_f64(self.model, self.theta.detach()[:NUMEL].clone(),
                                          stream[self.t * K:(self.t + 1) * K])
            out.append(x)
        return out

    def clip(self, norm: float) -> float:
        return 1.0 if self.max_norm is None else min(1.0, self.max_norm / (norm + 1e-6))

    def step(self) -> torch.Tensor:
        xs, count, n = self.sums(), K * self.world, self.world
        if self.t < self.warmup:
            grad = sum(xs) / count
            self.theta.grad = grad * self.clip(float(grad.norm()))
            self.opt.step()
            if self.t + 1 == self.warmup:
                self.freeze()
        else:
            bound = math.sqrt(n * sum(float(x.square().sum()) for x in xs)) / count
            self.bounds.append(bound)
            us = [x * n * self.clip(bound) / count for x in xs]
            hs = [BETAS[0] * self.m + (1 - BETAS[0]) * u + e for u, e in zip(us, self.errors)]
            sent = [sign_rms(h) for h in hs]
            self.errors = [(h - s).masked_fill(self.mask, 0) for h, s in zip(hs, sent)]
            h_server = sum(sent) / n + self.server
            self.m = sign_rms(h_server).masked_fill(self.mask, 0)
            self.server = (h_server - sign_rms(h_server)).masked_fill(self.mask, 0)
            k = self.frozen + self.t - self.warmup + 1
            d = self.v.sqrt() / math.sqrt(1 - BETAS[1] ** self.frozen) + EPS
            with torch.no_grad():
                new = self.theta * (1 - LR * WD) - LR / (1 - BETAS[0] ** k) * self.m / d
                self.theta.copy_(torch.where(self.mask, self.theta, new))
        self.t += 1
        return self.theta.detach()[:NUMEL].clone()

    def freeze(self) -> None:
        state = self.opt.state[self.theta]
        self.m, self.v = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        self.frozen, self.mask = int(state["step"]), state["exp_avg_sq"] == 0
        self.errors = [torch.zeros(self.size, dtype=torch.float64) for _ in range(self.world)]
        self.server = torch.zeros(self.size, dtype=torch.float64)

    def run(self, steps: int = STEPS) -> list[torch.Tensor]:
        return [self.step() for _ in range(steps)]


def check_against_reference(runs: list[dict], world: int, max_norm: float | None = None, tol: float = 1e-5) -> None:
    ref = OnebitReference(world, max_norm)
    want = ref.run()
    for t in range(STEPS):
        for r in range(world):
            assert torch.equal(runs[r]["params"][t], runs[0]["params"][t]), (t, r)  # replicas agree
        assert rel_err(runs[0]["params"][t], want[t]) < tol, (t, rel_err(runs[0]["params"][t], want[t]))
    assert rel_err(runs[0]["momentum"], ref.m) < tol
    for r in range(world):
        assert torch.equal(runs[r]["momentum"], runs[0]["momentum"])
        assert rel_err(runs[r]["worker_error"], ref.errors[r]) < 1e-4
        assert runs[r]["frozen_step"] == WARMUP
    got_bounds = [h["grad_norm"] for h in runs[0]["history"][WARMUP:]]
    assert got_bounds == pytest.approx(ref.bounds, rel=1e-5)
    assert rel_err(want[-1], want[WARMUP - 1]) > 1e-2  # the compressed stage moved the parameters


# ------------------------------------------------------------------------------ world 2 and 3
class WithUnused(torch.nn.Module):
    """The tiny model with a layer in the middle of the flat buffer that the loss never uses."""

    def __init__(self):
        super().__init__()
        base = tiny_model(0)
        self.first = base[0]
        self.unused = torch.nn.Linear(5, 5)
        self.rest = torch.nn.Sequential(base[1], base[2])

    def forward(self, x):
        return self.rest(self.first(x))


def unused_run(rank: int) -> dict:
    engine = Engine(WithUnused(), config(max_steps=STEPS), mse_loss)
    it = iter(worker_stream(rank, K * (STEPS + 1)))
    engine.fit(it, steps=WARMUP)
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.fit(it)
    st = engine.strategy.state
    out = {"moved": {n: not torch.equal(p.detach(), frozen[n]) for n, p in engine.model.named_parameters()},
           "mask": st.mask.clone(), "momentum": st.momentum.clone(), "worker_error": st.worker_error.clone(),
           "padding": engine.ctx.gather_buf[engine.flat.numel:].clone(), "numel": engine.flat.numel}
    engine.close()
    return out


def wide_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))


def wide_stream(rank: int, n: int) -> list:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)) for _ in range(n)]


def bytes_runs(rank: int) -> dict:
    """fp32 zero1 and onebit_adam on a 33k-parameter model at the defaults (groups of 128)."""
    out = {}
    for name, kw in [("zero1", {"strategy": "zero1"}), ("onebit", {"strategy": "onebit_adam", "onebit_warmup_steps": 2})]:
        engine = Engine(wide_model(), EngineConfig(lr=1e-3, max_steps=5, **kw), mse_loss)
        out[name] = [h["wire_bytes"] for h in engine.fit(wide_stream(rank, 5))]
        out["padded"] = engine.flat.padded
        engine.close()
    return out


RESUMES = [  # (name, settings, steps before the save)
    ("before_freeze", {}, WARMUP - 1),
    ("compressed", {}, WARMUP + 2),
    ("rule", {"onebit_warmup_steps": None, "onebit_window": 3, "onebit_min_warmup": 1, "onebit_tolerance": 100.0,
              "onebit_max_warmup_fraction": 1.0}, 2),  # the rule fires at step 4: its norms must survive
    ("bf16", {"compute_dtype": "bfloat16"}, WARMUP + 2),
]


def resume_runs(rank: int, root: str) -> dict:
    out = {}
    for name, kw, save_at in RESUMES:
        stream = worker_stream(rank, 100, dtype=data_dtype(kw))
        straight = Engine(tiny_model(0), config(**kw), mse_loss)
        h_straight = straight.fit(stream)
        first = Engine(tiny_model(0), config(**kw), mse_loss)
        h_first = first.fit(stream, steps=save_at)
        first.save(f"{root}/{name}")
        first.close()
        model = tiny_model(123)  # everything must come from the checkpoint
        resumed = Engine.load(f"{root}/{name}", model, config(**kw), mse_loss)
        h_second = resumed.fit(itertools.islice(stream, resumed.consumed, None))
        a, b = straight.strategy.state, resumed.strategy.state
        out[name] = {"params": torch.equal(flat_params(straight.model), flat_params(model)),
                     "state": all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values())),
                     "frozen": (a.frozen_step, b.frozen_step), "steps": [h["step"] for h in h_second],
                     "losses": [h["loss"] for h in h_straight] == [h["loss"] for h in h_first + h_second]}
        straight.close()
        resumed.close()
    return out


def _world2(rank: int, world: int, root: str) -> dict:
    return {"plain": train(rank, {}), "clip": train(rank, {"max_grad_norm": 0.05}),
            "bf16": train(rank, {"compute_dtype": "bfloat16"}), "unused": unused_run(rank),
            "bytes": bytes_runs(rank), "resume": resume_runs(rank, root)}


def _world3(rank: int, world: int) -> dict:
    return {"plain": train(rank, {})}


@functools.cache
def world2() -> list[dict]:
    return spawn(_world2, 2, tempfile.mkdtemp(prefix="onebit-"))


def test_world2_matches_the_float64_reference():
    check_against_reference([r["plain"] for r in world2()], 2)


def test_world3_matches_the_float64_reference():
    check_against_reference([r["plain"] for r in spawn(_world3, 3)], 3)


def test_world1_matches_the_float64_reference_and_sends_nothing():
    run = train(0, {})
    check_against_reference([run], 1)
    assert [h["wire_bytes"] for h in run["history"]] == [0] * STEPS


def test_clipping_scales_every_contribution_by_the_bound():
    runs = [r["clip"] for r in world2()]
    check_against_reference(runs, 2, max_norm=0.05)
    assert min(h["grad_norm"] for h in runs[0]["history"]) > 0.05  # clipping acted on every step
    plain = world2()[0]["plain"]["params"][-1]
    assert rel_err(runs[0]["params"][-1], plain) > 1e-3  # and changed the run


def test_bf16_keeps_an_fp32_master_and_identical_replicas():
    runs = [r["bf16"] for r in world2()]
    for r in runs:
        assert r["master"] is not None and r["master"].dtype == torch.float32
        assert torch.equal(r["master"], runs[0]["master"]) and torch.equal(r["gather_buf"], runs[0]["gather_buf"])
        assert torch.equal(r["gather_buf"], r["master"].to(torch.bfloat16))
        assert all(torch.equal(p, q) for p, q in zip(r["params"], runs[0]["params"]))
    master = runs[0]["master"][:NUMEL]
    # updates smaller than a bf16 step: the master keeps them where the bf16 parameters cannot
    assert not torch.equal(master, master.to(torch.bfloat16).float())
    assert rel_err(runs[0]["params"][-1], OnebitReference(2).run()[-1]) < 3e-2
    assert world2()[0]["plain"]["master"] is None  # fp32: the parameters are the master, no copy


def test_unused_parameters_do_not_move_after_the_freeze():
    for r in world2():
        out = r["unused"]
        assert out["moved"] == {"first.weight": True, "first.bias": True, "unused.weight": False,
                                "unused.bias": False, "rest.1.weight": True, "rest.1.bias": True}
        lo = IN * HIDDEN + HIDDEN  # the unused layer's values in the flat buffer
        mask = out["mask"]
        assert mask[lo:lo + 30].all() and not mask[:lo].any() and not mask[lo + 30:out["numel"]].any()
        assert mask[out["numel"]:].all()  # padding
        assert not out["momentum"][mask].any() and not out["worker_error"][mask].any()
        assert not out["padding"].any()


def test_bytes_per_compressed_step_are_the_formula_and_under_a_25th_of_zero1():
    runs = world2()
    padded_wide, shard = runs[0]["bytes"]["padded"], runs[0]["bytes"]["padded"] // 2
    small = 2 * (2 - 1) * (4 + 3 * 2) * 8 // 2
    zero1 = 2 * shard * 4 + small  # fp32 reduce-scatter + all-gather + the small all-reduce
    one = compressed_step_bytes(padded_wide, 2)
    assert one == 2 * (shard // 8 + 4 * shard // 128) + small  # 1 bit + an fp32 scale per 128, both ways
    for r in runs:
        assert r["bytes"]["zero1"] == [zero1] * 5
        # warmup = zero1; the freeze step also gathers m and v once; then the formula
        assert r["bytes"]["onebit"] == [zero1, zero1 + 2 * shard * 4, one, one, one]
    assert 25 * one <= zero1
    print(f"bytes per step: onebit {one}, zero1 {zero1}, ratio {one / zero1:.4f}")


def test_resume_across_the_warmup_boundary_is_bit_exact():
    for r in world2():
        for name, kw, save_at in RESUMES:
            out = r["resume"][name]
            assert out["steps"] == list(range(save_at + 1, STEPS + 1)), name
            assert out["params"] and out["state"] and out["losses"], (name, out)
            assert out["frozen"] == ((4, 4) if name == "rule" else (WARMUP, WARMUP)), name


# ------------------------------------------------------------------------------ world 1
def test_variance_rule_freezes_where_the_reference_says():
    """window 3, tolerance 0.3: the first step k >= 5 at which the reference's bias-corrected L1
    norm of v moved by at most 30% over 3 steps; and the cap when it never settles."""
    ref = OnebitReference(1, warmup=10**9)
    norms = []
    for k in range(1, STEPS + 1):
        ref.step()
        v = ref.opt.state[ref.theta]["exp_avg_sq"]
        norms.append(float(v.sum()) / (1 - BETAS[1] ** k))
    want = next(k for k in range(5, STEPS + 1) if abs(norms[k - 1] - norms[k - 4]) <= 0.3 * norms[k - 4])
    assert WARMUP < want < STEPS
    rule = {"onebit_warmup_steps": None, "onebit_window": 3, "onebit_tolerance": 0.3, "onebit_min_warmup": 5,
            "onebit_max_warmup_fraction": 1.0}
    assert train(0, rule)["frozen_step"] == want
    capped = {**rule, "onebit_tolerance": 1e-9, "onebit_max_warmup_fraction": 0.5}
    assert train(0, capped)["frozen_step"] == STEPS // 2


def test_non_finite_compressed_step_is_skipped_or_stops():
    bad = list(worker_stream(0, K * (STEPS + 1)))
    bad[2 * (WARMUP + 1)] = (bad[2 * (WARMUP + 1)][0] * float("nan"), bad[2 * (WARMUP + 1)][1])  # step WARMUP + 2
    engine = Engine(tiny_model(0), config(), mse_loss)
    it = iter(bad)
    engine.fit(it, steps=WARMUP + 1)
    before = {k: v.clone() for k, v in engine.strategy.state.tensors().items()}
    params = flat_params(engine.model)
    hist = engine.fit(it, steps=1)
    assert hist[0]["skipped"] and math.isnan(hist[0]["grad_norm"])
    assert all(torch.equal(v, before[k]) for k, v in engine.strategy.state.tensors().items())
    assert torch.equal(flat_params(engine.model), params) and engine.shard_state.step == WARMUP + 1
    assert not engine.fit(it, steps=1)[0]["skipped"]
    engine.close()
    strict = Engine(tiny_model(0), config(nan_policy="stop"), mse_loss)
    with pytest.raises(NonFiniteGradientError, match="non-finite gradient"):
        strict.fit(bad)


def test_int8_parameter_deltas_in_warmup_then_the_master_is_kept_whole():
    """param_codec shapes the warmup rounds only; with int8 parameter deltas the held parameters
    are not the master, so the freeze gathers an fp32 master and installs it exactly."""
    run = train(0, {"param_codec": "int8"})
    assert run["frozen_step"] == WARMUP and run["master"] is not None
    assert torch.equal(run["gather_buf"], run["master"])
    assert rel_err(run["params"][-1], OnebitReference(1).run()[-1]) < 1e-3


def test_refuses_another_optimizer_or_a_gradient_codec():
    with pytest.raises(ValueError, match="strategy 'onebit_adam' is 1-bit Adam.*set optimizer='adamw'"):
        Engine(tiny_model(0), config(optimizer="sgd"), mse_loss)
    with pytest.raises(ValueError, match="needs exact gradients for the variance it freezes: set codec='none'"):
        Engine(tiny_model(0), config(codec="loco4"), mse_loss)


@pytest.mark.parametrize("kw, fragment", [
    ({"onebit_warmup_steps": 0}, "onebit_warmup_steps must be None (the variance rule decides) or a positive integer"),
    ({"onebit_window": 0}, "onebit_window must be a positive integer"),
    ({"onebit_tolerance": -0.1}, "onebit_tolerance must be a finite number > 0"),
    ({"onebit_max_warmup_fraction": 2.0}, "onebit_max_warmup_fraction must be a finite number in (0, 1]"),
])
def test_bad_settings_are_refused(kw, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        config(**kw)
