"""diloco and sparseloco (engine/strategies/diloco.py, sparseloco.py) in gloo groups of 2 and 3
against float64 references of their equations written out sequentially
(docs/local_steps.md): one and three outer rounds, with and without overlap; replicas' theta_sync
bit-identical; bytes per round equal to the formula; bit-exact resume; refused configurations."""

from __future__ import annotations

import copy
import itertools
import math
import re

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core.rounds import NonFiniteGradientError
from engine.parallel.local_group import spawn
from engine.strategies import diloco, sparseloco
from tests.tiny import flat_params, mean_grad_f64, mse_loss, rel_err, tiny_model, worker_stream

K, H, ROUNDS, LR, WD = 2, 3, 3, 1e-2, 0.1
OUTER = {"inner_steps": H, "outer_lr": 0.7}  # the shared section; each strategy's own below
OWN = {"diloco": {"outer_momentum": 0.9},
       "sparseloco": {"topk_chunk": 32, "topk_density": 0.25, "topk_value_bits": 2, "sparse_error_beta": 0.95}}
NUMEL = sum(p.numel() for p in tiny_model(0).parameters())


def padded(world: int) -> int:
    return -(-NUMEL // (8 * world)) * 8 * world  # align 8


def config(strategy: str, rounds: int = ROUNDS, **kw) -> EngineConfig:
    return EngineConfig(strategy=strategy, lr=LR, weight_decay=WD, micro_batches=K, max_steps=rounds * H,
                        align=8, **{**OUTER, **OWN.get(strategy, {}), **kw})


def train(rank: int, world: int, strategy: str, kw: dict, rounds: int = ROUNDS) -> dict:
    """Snapshots after every outer round: this worker's parameters, theta_sync, the history."""
    engine = Engine(tiny_model(0), config(strategy, rounds, **kw), mse_loss)
    it = iter(worker_stream(rank, K * H * (rounds + 1)))
    local, sync, history = [], [], []
    for _ in range(rounds):
        history += engine.fit(it, steps=H)
        local.append(flat_params(engine.model))
        sync.append(engine.strategy.theta_sync[:NUMEL].clone())
    engine.close()
    return {"local": local, "sync": sync, "history": history}


def _variants(rank: int, world: int) -> dict:
    return {(s, overlap): train(rank, world, s, {"outer_overlap": overlap})
            for s in ("diloco", "sparseloco") for overlap in (False, True)}


# ------------------------------------------------------------------------------ the reference
def topk_2bit(e: torch.Tensor, chunk: int, k: int, bits: int) -> torch.Tensor:
    """What SparseLoCo sends of e, decoded: per chunk the k largest |e| (lower index first among
    equals), sign x a magnitude level on the uniform grid of 2^(bits-1) levels over [lo, hi]."""
    out = torch.zeros_like(e)
    levels = 2 ** (bits - 1)
    for start in range(0, e.numel(), chunk):
        part = e[start:start + chunk].tolist()
        keep = sorted(range(len(part)), key=lambda j: (-abs(part[j]), j))[:k]
        lo, hi = min(abs(part[j]) for j in keep), max(abs(part[j]) for j in keep)
        step = (hi - lo) / levels
        for j in keep:
            q = 0 if step == 0 else min(levels - 1, max(0, math.floor((abs(part[j]) - lo) / step)))
            out[start + j] = math.copysign(lo + (q + 0.5) * step, part[j]) if part[j] != 0 else lo + (q + 0.5) * step
    return out


def outer_sgd(outer: tuple, sync: torch.Tensor, deltas: list[torch.Tensor], shares: list[float]) -> torch.Tensor:
    """diloco's outer step: torch SGD (``outer``: its parameter and optimizer) from ``sync`` on
    the share-weighted pseudo-gradients."""
    param, opt = outer
    with torch.no_grad():
        param.copy_(sync)
    param.grad = sum(a * d for a, d in zip(shares, deltas))
    opt.step()
    return param.detach().clone()


class LocalReference:
    """Float64, sequential: each worker's AdamW steps, then the outer round of the strategy."""

    def __init__(self, world: int, strategy: str, overlap: bool = False, steps_per_round=None):
        self.model = copy.deepcopy(tiny_model(0)).double()
        self.world, self.strategy, self.overlap = world, strategy, overlap
        self.size = padded(world)
        theta0 = torch.zeros(self.size, dtype=torch.float64)
        theta0[:NUMEL] = flat_params(self.model).double()
        self.sync = theta0.clone()
        self.thetas = [theta0.clone().requires_grad_(True) for _ in range(world)]
        self.opts = [torch.optim.AdamW([t], lr=LR, weight_decay=WD) for t in self.thetas]
        self.streams = [worker_stream(r, K * H * (ROUNDS + 8)) for r in range(world)]
        self.cursor = [0] * world
        sync_param = self.sync.clone().requires_grad_(True)
        self.outer = (sync_param, torch.optim.SGD([sync_param], lr=OUTER["outer_lr"], momentum=OWN["diloco"]["outer_momentum"],
                                                  nesterov=True))
        self.errors = [torch.zeros(self.size, dtype=torch.float64) for _ in range(world)]
        self.steps_per_round = steps_per_round  # [round][worker] inner steps (default H each)
        self.submitted = [None] * world
        self.result = None

    def inner(self, w: int, steps: int) -> None:
        theta, opt = self.thetas[w], self.opts[w]
        for _ in range(steps):
            start, self.cursor[w] = self.cursor[w], self.cursor[w] + K
            g = torch.zeros(self.size, dtype=torch.float64)
            g[:NUMEL] = mean_grad_f64(self.model, theta.detach()[:NUMEL].clone(), self.streams[w][start:start + K])
            theta.grad = g
            opt.step()

    def outer_step(self, deltas: list[torch.Tensor], shares: list[float]) -> torch.Tensor:
        if self.strategy == "diloco":
            return outer_sgd(self.outer, self.sync, deltas, shares)
        sent = []
        for w, d in enumerate(deltas):
            self.errors[w] = OWN["sparseloco"]["sparse_error_beta"] * self.errors[w] + d
            s = topk_2bit(self.errors[w], OWN["sparseloco"]["topk_chunk"], 8, OWN["sparseloco"]["topk_value_bits"])  # k = 0.25 x 32
            self.errors[w] = self.errors[w] - s
            sent.append(s)
        return self.sync - OUTER["outer_lr"] * sum(a * s for a, s in zip(shares, sent))

    def run(self, rounds: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """(every worker's parameters, theta_sync) after each round, unpadded."""
        out = []
        for t in range(rounds):
            counts = self.steps_per_round[t] if self.steps_per_round else [H] * self.world
            for w in range(self.world):
                self.inner(w, counts[w])
            with torch.no_grad():
                if self.overlap and self.result is not None:  # merge the round sent one period ago
                    for w, theta in enumerate(self.thetas):
                        theta.add_(self.result - self.submitted[w])
                    self.sync = self.result
                self.submitted = [theta.detach().clone() for theta in self.thetas]
                total = sum(counts)
                shares = [c / total for c in counts]  # equal micro-batch sizes: samples ~ steps
                new = self.outer_step([self.sync - theta.detach() for theta in self.thetas], shares)
                if self.overlap:
                    self.result = new
                else:
                    self.sync = new
                    for theta in self.thetas:
                        theta.copy_(new)
            out.append(([th.detach()[:NUMEL].clone() for th in self.thetas],
                        (self.result if self.overlap else self.sync)[:NUMEL].clone()))
        return out


# ------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("world", [2, 3])
def test_one_and_three_rounds_match_the_reference(world):
    runs = spawn(_variants, world)
    for (strategy, overlap), _ in runs[0].items():
        want = LocalReference(world, strategy, overlap).run(ROUNDS)
        for t in range(ROUNDS):
            sync = runs[0][(strategy, overlap)]["sync"][t]
            for r in range(world):
                got = runs[r][(strategy, overlap)]
                assert torch.equal(got["sync"][t], sync), (strategy, overlap, t, r)  # replicas agree
                assert rel_err(got["local"][t], want[t][0][r]) < 1e-6, (strategy, overlap, t, r)
                if not overlap:
                    assert torch.equal(got["local"][t], sync)  # theta_w = theta_sync after the round
            assert rel_err(sync, want[t][1]) < 1e-6, (strategy, overlap, t)
        # the run moved, and the workers really went apart between rounds
        assert rel_err(want[-1][1], flat_params(tiny_model(0))) > 1e-2
        if overlap:
            assert not torch.equal(runs[0][(strategy, overlap)]["local"][-1], runs[1][(strategy, overlap)]["local"][-1])


def test_the_variants_are_different_computations():
    """Guards the comparison above: overlap, sparsity and the outer momentum all change the result."""
    finals = {(s, o): LocalReference(2, s, o).run(ROUNDS)[-1][1] for s in ("diloco", "sparseloco")
              for o in (False, True)}
    assert rel_err(finals[("diloco", True)], finals[("diloco", False)]) > 1e-4
    assert rel_err(finals[("sparseloco", False)], finals[("diloco", False)]) > 1e-4
    assert rel_err(finals[("sparseloco", True)], finals[("sparseloco", False)]) > 1e-4


def _bytes(rank: int, world: int) -> dict:
    out = {}
    for name, strategy, kw in [("diloco", "diloco", {}), ("diloco_bf16", "diloco", {"pseudo_grad_dtype": "bfloat16"}),
                               ("sparseloco", "sparseloco", {}),
                               ("contributors", "sparseloco", {"sparse_aggregate": "contributors"})]:
        out[name] = train(rank, world, strategy, kw, rounds=2)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_per_round_equal_the_formula(world):
    runs = spawn(_bytes, world)
    cfg = config("sparseloco")
    want = {"diloco": diloco.round_bytes(padded(world), world),
            "diloco_bf16": diloco.round_bytes(padded(world), world, "bfloat16"),
            "sparseloco": sparseloco.round_bytes(cfg, padded(world), world),
            "contributors": sparseloco.round_bytes(cfg, padded(world), world)}
    for name, bytes_ in want.items():
        for r in range(world):
            hist = runs[r][name]["history"]
            assert [h["wire_bytes"] for h in hist] == [0, 0, bytes_] * 2, (name, r)  # only at an outer round
            assert [h["rounds"] for h in hist] == [0, 0, 1] * 2
            assert hist[H - 1]["outer"][0]["samples"] == world * H * K * 4  # every worker's samples of the period
            assert torch.equal(runs[r][name]["sync"][-1], runs[0][name]["sync"][-1])
    small = 2 * (world - 1) * (2 + 4 * world) * 8 // world
    assert want["diloco"] - small == 2 * (want["diloco_bf16"] - small)  # bf16 halves the pseudo-gradient
    assert 5 * sparseloco.make_codec(cfg).payload_bytes(padded(world)) < 4 * padded(world)  # density 0.25 here
    # bf16 on the wire rounds the average; the per-contributor mean differs from sum / R
    assert 0 < rel_err(runs[0]["diloco_bf16"]["sync"][-1], runs[0]["diloco"]["sync"][-1]) < 1e-2
    assert rel_err(runs[0]["contributors"]["sync"][-1], runs[0]["sparseloco"]["sync"][-1]) > 1e-4


def test_world1_diloco_with_outer_lr_1_is_plain_adamw():
    """H = 1, outer lr 1, no momentum: theta_sync - (theta_sync - theta_w) = theta_w, so the run is
    the zero1 AdamW run (a check of the bookkeeping that needs no reference)."""
    data = worker_stream(0, 40)
    cfg = dict(lr=LR, weight_decay=WD, micro_batches=K, max_steps=10, align=8)
    local = Engine(tiny_model(0), EngineConfig(strategy="diloco", inner_steps=1, outer_lr=1.0, outer_momentum=0.0,
                                               **cfg), mse_loss)
    local.fit(data)
    plain = Engine(tiny_model(0), EngineConfig(strategy="zero1", **cfg), mse_loss)
    plain.fit(data)
    assert rel_err(flat_params(local.model), flat_params(plain.model)) < 1e-6
    assert rel_err(flat_params(local.model), flat_params(tiny_model(0))) > 1e-2
    local.close(), plain.close()


def _straight_then_resumed(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, strategy, kw in [("diloco_overlap", "diloco", {"outer_overlap": True}),
                               ("sparseloco", "sparseloco", {}),
                               ("sparseloco_overlap", "sparseloco", {"outer_overlap": True})]:
        stream = worker_stream(rank, 100)
        straight = Engine(tiny_model(0), config(strategy, **kw), mse_loss)
        h_straight = straight.fit(stream)
        straight.close()
        first = Engine(tiny_model(0), config(strategy, **kw), mse_loss)
        h_first = first.fit(stream, steps=4)  # mid-period, with round 0 finished but not merged (overlap)
        first.save(f"{root}/{name}")
        first.close()
        model = tiny_model(123)  # everything must come from the checkpoint
        resumed = Engine.load(f"{root}/{name}", model, config(strategy, **kw), mse_loss)
        h_second = resumed.fit(itertools.islice(stream, resumed.consumed, None))
        out[name] = {"equal": torch.equal(flat_params(straight.model), flat_params(model)),
                     "sync_equal": torch.equal(straight.strategy.theta_sync, resumed.strategy.theta_sync),
                     "losses": [h["loss"] for h in h_straight] == [h["loss"] for h in h_first + h_second],
                     "steps": [h["step"] for h in h_second]}
        resumed.close()
    return out


def test_resume_world2_is_bit_exact(tmp_path):
    for per_rank in spawn(_straight_then_resumed, 2, str(tmp_path)):
        for name, out in per_rank.items():
            assert out["steps"] == list(range(5, ROUNDS * H + 1)), name
            assert out["equal"] and out["sync_equal"] and out["losses"], (name, out)


def _period_run(rank: int, world: int) -> dict:
    import time

    def slow_loss(model, batch):
        time.sleep(0.04 if rank == 1 else 0.01)  # rank 1 is four times slower
        return mse_loss(model, batch)

    cfg = config("diloco", rounds=10, outer_period_s=0.25)  # max_steps 30 inner steps
    engine = Engine(tiny_model(0), cfg, slow_loss)
    history = engine.fit(worker_stream(rank, 400))
    out = {"history": history, "sync": engine.strategy.theta_sync[:NUMEL].clone(), "local": flat_params(engine.model)}
    engine.close()
    return out


def test_outer_period_weights_workers_by_samples():
    runs = spawn(_period_run, 2)
    # inner steps of each worker in each period, read from its history (a round closes a period)
    periods = []
    for run in runs:
        counts, n = [], 0
        for h in run["history"]:
            n += 1
            if h["rounds"]:
                counts.append(n)
                n = 0
        periods.append(counts)
    assert len(periods[0]) == len(periods[1]) >= 2
    assert sum(periods[0]) == 30 > sum(periods[1])  # the fast worker ran more and set the stop
    steps = [list(c) for c in zip(*periods)]
    ref = LocalReference(2, "diloco", steps_per_round=steps).run(len(steps))
    assert torch.equal(runs[0]["sync"], runs[1]["sync"])
    assert rel_err(runs[0]["sync"], ref[-1][1]) < 1e-6
    assert rel_err(runs[1]["local"], ref[-1][1]) < 1e-6
    outer = [h["outer"][0] for h in runs[0]["history"] if h["rounds"]]
    assert [o["samples"] for o in outer] == [4 * K * sum(c) for c in steps]


@pytest.mark.parametrize("kw, fragment", [
    ({"codec": "loco4"}, "set codec='none'"),
    ({"param_codec": "int8"}, "param_codec='auto'"),
    ({"accumulation": "grow"}, "accumulation='fixed'"),
    ({"global_micro_batches": 4, "balance": "speed"}, "balance='equal'"),
])
@pytest.mark.parametrize("strategy", ["diloco", "sparseloco"])
def test_refuses_what_it_cannot_honour(strategy, kw, fragment):
    with pytest.raises(ValueError, match=re.escape(f"strategy {strategy!r} cannot honour this configuration")) as err:
        Engine(tiny_model(0), EngineConfig(strategy=strategy, **kw), mse_loss)
    assert fragment in str(err.value)


def _uneven_batch(rank: int, world: int):
    Engine(tiny_model(0), EngineConfig(strategy="diloco", global_micro_batches=3), mse_loss)


def test_refuses_a_global_batch_the_workers_cannot_share_equally():
    with pytest.raises(AssertionError, match="global_micro_batches=3 is the micro-batches of one inner step"):
        spawn(_uneven_batch, 2)


def test_resume_refuses_another_overlap_setting(tmp_path):
    engine = Engine(tiny_model(0), config("diloco"), mse_loss)
    engine.fit(worker_stream(0, 40), steps=H)
    engine.save(str(tmp_path / "c"))
    engine.close()
    with pytest.raises(ValueError, match="outer_overlap=False and this run has outer_overlap=True"):
        Engine.load(str(tmp_path / "c"), tiny_model(0), config("diloco", outer_overlap=True), mse_loss)


def test_non_finite_inner_gradient_skips_that_step_or_stops():
    data = worker_stream(0, 40)
    bad = list(data)
    bad[2] = (bad[2][0] * float("nan"), bad[2][1])  # the second inner step
    engine = Engine(tiny_model(0), config("sparseloco", rounds=2), mse_loss)
    hist = engine.fit(bad)
    assert [h["skipped"] for h in hist] == [False, True, False, False, False, False]
    assert torch.isfinite(flat_params(engine.model)).all()
    engine.close()
    strict = Engine(tiny_model(0), config("diloco", nan_policy="stop"), mse_loss)
    with pytest.raises(NonFiniteGradientError, match="non-finite gradient in inner step 2 on rank 0"):
        strict.fit(bad)
