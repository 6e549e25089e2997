"""diloco and sparseloco with a node as one replica (engine/strategies/node_replica.py,
docs/nodes.md, "diloco and sparseloco: a node as one replica"), M nodes of G ranks in real gloo
groups, against float64 references: each node
takes AdamW steps on the mean gradient of all its ranks' micro-batches, and the outer step runs
on the nodes' pseudo-gradients (sparseloco's top-k per rank slice, as each rank sends its own).
Also: every rank of a node holds the same parameters after every inner step; theta_sync is the
same everywhere; the bytes per link class equal the formula; a resume is bit-exact; a node whose
rank's data runs out stops with the rest."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from engine.strategies.sparseloco import make_codec
from tests.engine.test_local_steps import outer_sgd, topk_2bit
from tests.tiny import flat_params, mean_grad_f64, mse_loss, rel_err, tiny_model, worker_stream

K, H, ROUNDS, LR, WD, OUTER_LR = 2, 3, 2, 1e-2, 0.1, 0.7
OWN = {"diloco": {"outer_momentum": 0.9},
       "sparseloco": {"topk_chunk": 32, "topk_density": 0.25, "topk_value_bits": 2, "sparse_error_beta": 0.95}}
NUMEL = sum(p.numel() for p in tiny_model(0).parameters())


def _env(g: int) -> dict:
    return {"LOCAL_WORLD_SIZE": str(g)}


def config(strategy: str, rounds: int = ROUNDS, **kw) -> EngineConfig:
    return EngineConfig(strategy=strategy, lr=LR, weight_decay=WD, micro_batches=K, max_steps=rounds * H,
                        align=8, inner_steps=H, outer_lr=OUTER_LR, topology="two_level",
                        **{**OWN[strategy], **kw})


def train(rank: int, world: int, strategy: str, kw: dict, rounds: int = ROUNDS) -> dict:
    engine = Engine(tiny_model(0), config(strategy, rounds, **kw), mse_loss)
    assert engine.topology == "two_level" and engine.strategy.replica is not None
    it = iter(worker_stream(rank, K * H * (rounds + 1)))
    inner, sync, history = [], [], []
    for _ in range(rounds * H):
        history += engine.fit(it, steps=1)
        inner.append(flat_params(engine.model))
    sync = engine.strategy.whole_theta_sync(engine.ctx)[:NUMEL].clone()
    engine.close()
    return {"inner": inner, "sync": sync, "history": history,
            "state_numel": engine.shard_state.master.numel(), "padded": engine.flat.padded}


def _variants(rank: int, world: int) -> dict:
    return {(s, o): train(rank, world, s, {"outer_overlap": o}) for s in ("diloco", "sparseloco") for o in (False, True)}


class NodeReference:
    """Float64, sequential: node m's AdamW steps on the mean gradient of its ranks' micro-batches,
    then the outer step on the nodes' pseudo-gradients (equal samples: shares 1/M)."""

    def __init__(self, m: int, g: int, strategy: str, overlap: bool, padded: int):
        self.m, self.g, self.strategy, self.overlap, self.size = m, g, strategy, overlap, padded
        self.model = copy.deepcopy(tiny_model(0)).double()
        theta0 = torch.zeros(padded, dtype=torch.float64)
        theta0[:NUMEL] = flat_params(self.model).double()
        self.sync = theta0.clone()
        self.thetas = [theta0.clone().requires_grad_(True) for _ in range(m)]
        self.opts = [torch.optim.AdamW([t], lr=LR, weight_decay=WD) for t in self.thetas]
        self.streams = [worker_stream(r, K * H * (ROUNDS + 2)) for r in range(m * g)]
        param = self.sync.clone().requires_grad_(True)
        self.outer = (param, torch.optim.SGD([param], lr=OUTER_LR, momentum=OWN["diloco"]["outer_momentum"],
                                             nesterov=True))
        self.errors = [torch.zeros(padded, dtype=torch.float64) for _ in range(m)]
        self.step = 0
        self.submitted, self.result = None, None

    def inner(self) -> list[torch.Tensor]:
        """One inner step of every node; each node's parameters after it."""
        t = self.step
        for node, (theta, opt) in enumerate(zip(self.thetas, self.opts)):
            batches = [b for r in range(node * self.g, (node + 1) * self.g) for b in self.streams[r][t * K:(t + 1) * K]]
            grad = torch.zeros(self.size, dtype=torch.float64)
            grad[:NUMEL] = mean_grad_f64(self.model, theta.detach()[:NUMEL].clone(), batches)
            theta.grad = grad
            opt.step()
        self.step += 1
        return [th.detach()[:NUMEL].clone() for th in self.thetas]

    def slices(self, v: torch.Tensor) -> list[torch.Tensor]:
        """Rank l's slice of a whole vector: the shards (node, l) of every node, in node order."""
        return [v.view(self.m, self.g, -1)[:, l, :].reshape(-1) for l in range(self.g)]

    def outer_step(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        shares = [1.0 / self.m] * self.m
        if self.strategy == "diloco":
            return outer_sgd(self.outer, self.sync, deltas, shares)
        own = OWN["sparseloco"]
        k = int(own["topk_chunk"] * own["topk_density"])
        sent = []
        for node, d in enumerate(deltas):
            self.errors[node] = own["sparse_error_beta"] * self.errors[node] + d
            s = torch.zeros(self.size, dtype=torch.float64)
            view = s.view(self.m, self.g, -1)
            for l, e in enumerate(self.slices(self.errors[node])):  # each rank its slice
                view[:, l, :] = topk_2bit(e, own["topk_chunk"], k, own["topk_value_bits"]).view(self.m, -1)
            self.errors[node] = self.errors[node] - s
            sent.append(s)
        return self.sync - OUTER_LR * sum(a * s for a, s in zip(shares, sent))

    def run(self, rounds: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        """(every node's parameters after each inner step, theta_sync at the end)."""
        inner = []
        for _ in range(rounds):
            for _ in range(H):
                inner.append(self.inner())
            with torch.no_grad():
                if self.overlap and self.result is not None:
                    for node, theta in enumerate(self.thetas):
                        theta.add_(self.result - self.submitted[node])
                    self.sync = self.result
                self.submitted = [th.detach().clone() for th in self.thetas]
                new = self.outer_step([self.sync - th.detach() for th in self.thetas])
                if self.overlap:
                    self.result = new
                else:
                    self.sync = new
                    for th in self.thetas:
                        th.copy_(new)
                inner[-1] = [th.detach()[:NUMEL].clone() for th in self.thetas]  # after the merge
        return inner, (self.result if self.overlap else self.sync)[:NUMEL].clone()


@pytest.mark.parametrize("m,g", [(2, 2), (2, 3), (3, 2)])
def test_node_replicas_match_the_float64_reference(m, g):
    world = m * g
    runs = spawn(_variants, world, env=_env(g), timeout=300)
    padded = runs[0][("diloco", False)]["padded"]
    for (strategy, overlap) in runs[0]:
        want_inner, want_sync = NodeReference(m, g, strategy, overlap, padded).run(ROUNDS)
        for r in range(world):
            got = runs[r][(strategy, overlap)]
            node, first = r // g, (r // g) * g
            assert got["state_numel"] == padded // g  # the inner state is sharded inside the node
            assert torch.equal(got["sync"], runs[0][(strategy, overlap)]["sync"])  # theta_sync everywhere
            for t in range(ROUNDS * H):
                assert torch.equal(got["inner"][t], runs[first][(strategy, overlap)]["inner"][t])  # one node, one replica
                assert rel_err(got["inner"][t], want_inner[t][node]) < 1e-5, (strategy, overlap, r, t)
        assert rel_err(runs[0][(strategy, overlap)]["sync"], want_sync) < 1e-5, (strategy, overlap)
        assert rel_err(want_sync, flat_params(tiny_model(0)).double()) > 1e-2  # it moved
        nodes_differ = not torch.equal(runs[0][(strategy, overlap)]["inner"][H - 2], runs[g][(strategy, overlap)]["inner"][H - 2])
        assert nodes_differ  # the nodes went apart between rounds


def _bytes_and_resume(rank: int, world: int, root: str) -> dict:
    out = {}
    for strategy in ("diloco", "sparseloco"):
        straight = Engine(tiny_model(0), config(strategy), mse_loss)
        straight.fit(worker_stream(rank, K * H * (ROUNDS + 1)))
        want = flat_params(straight.model)
        out[strategy] = {"history": straight.history, "padded": straight.flat.padded}
        straight.close()
        first = Engine(tiny_model(0), config(strategy), mse_loss)
        data = worker_stream(rank, K * H * (ROUNDS + 1))
        first.fit(iter(data), steps=H + 1)  # mid-period
        first.save(f"{root}/{strategy}")
        consumed = first.consumed
        first.close()
        model = tiny_model(0)
        resumed = Engine.load(f"{root}/{strategy}", model, config(strategy), mse_loss)
        resumed.fit(iter(data[consumed:]))
        out[strategy]["resumed_equal"] = torch.equal(flat_params(model), want)
        resumed.close()
    return out


def test_bytes_per_link_class_and_a_bit_exact_resume(tmp_path):
    m, g = 2, 2
    n = m * g
    runs = spawn(_bytes_and_resume, n, str(tmp_path), env=_env(g), timeout=300)
    padded = runs[0]["diloco"]["padded"]
    s = padded // n  # a shard; a rank's slice is m shards
    agree = (2 + 4 * n) * 8  # the outer round's small all-reduce over every rank

    def ring(size: int, peers: int, group: int) -> int:  # an all-reduce's share towards ``peers`` of a group
        return 2 * peers * size // group
    # an inner step stays inside the node: the reduce-scatter of the fp32 sum ((G-1) rows of m s
    # values), the all-gather of the new slice, the small all-reduces (exhausted?, totals, finite)
    inner_intra = 2 * (g - 1) * m * s * 4 + ring(8, g - 1, g) + ring(48, g - 1, g) + ring(8, g - 1, g)
    for strategy in ("diloco", "sparseloco"):
        if strategy == "diloco":  # the rail: reduce-scatter + all-gather of the slice in fp32
            rail = 2 * (m - 1) * s * 4
        else:  # the rail: this rank's top-k payload of its slice to each other node
            rail = (m - 1) * make_codec(config("sparseloco")).payload_bytes(m * s)
        round_intra = ring(agree, g - 1, n) + (g - 1) * m * s * 4  # + theta_sync gathered in the node
        round_inter = ring(agree, n - g, n) + rail
        for r in range(n):
            hist = runs[r][strategy]["history"]
            assert runs[r][strategy]["resumed_equal"], (strategy, r)
            assert len(hist) == ROUNDS * H
            for t, h in enumerate(hist):
                here = (t + 1) % H == 0  # an outer round at the end of every period
                got = (h["wire_bytes"], h["wire_bytes_intra"], h["wire_bytes_inter"])
                want = (ring(agree, n - 1, n) + rail if here else 0,
                        inner_intra + (round_intra if here else 0), round_inter if here else 0)
                assert got == want, (strategy, r, t, got, want)
    # what crosses a node's link per inner step: a sliver of the flat exchange's
    assert round_inter / H < 0.1 * inner_intra


def _ragged(rank: int, world: int) -> dict:
    engine = Engine(tiny_model(0), config("diloco", rounds=4), mse_loss)
    n = K * H * 4 if rank != 1 else K * (H + 1)  # rank 1 (node 0) runs out in the second period
    history = engine.fit(worker_stream(rank, n))
    engine.close()
    return {"steps": engine.step, "entries": len(history)}


def test_a_node_stops_when_one_of_its_ranks_runs_out():
    runs = spawn(_ragged, 4, env=_env(2), timeout=120)
    # node 0 stops together at once (rank 0 still had data); node 1 at its next outer round, where
    # it learns of it (as flat diloco's workers do); nobody waits for ever
    assert [r["steps"] for r in runs] == [H + 1, H + 1, 2 * H, 2 * H]


def test_node_replicas_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="two_level"):
        Engine(tiny_model(0), config("diloco"), mse_loss)  # one process: no nodes


def _periods(rank: int, world: int) -> dict:
    import time

    def slow_loss(model, batch):  # node 1 is much slower per micro-batch
        time.sleep(0.05 if rank >= 2 else 0.0)
        return mse_loss(model, batch)

    cfg = config("diloco", rounds=6, outer_period_s=0.3)
    engine = Engine(tiny_model(0), cfg, slow_loss)
    history = engine.fit(worker_stream(rank, K * H * 6))
    sync = engine.strategy.whole_theta_sync(engine.ctx)[:NUMEL].clone()
    engine.close()
    return {"steps": engine.step, "outer_at": [h["step"] for h in history if h["outer"]],
            "params": flat_params(engine.model), "sync": sync}


def test_outer_period_is_decided_per_node():
    """outer_period_s: each node decides when its period is over, all its ranks together (a rank
    deciding alone would leave its node-mates waiting in an inner step); the nodes then meet in
    the outer round, the slow node after fewer inner steps."""
    runs = spawn(_periods, 4, env=_env(2), timeout=180)
    for a, b in ((0, 1), (2, 3)):
        assert runs[a]["steps"] == runs[b]["steps"] and runs[a]["outer_at"] == runs[b]["outer_at"]
        assert torch.equal(runs[a]["params"], runs[b]["params"])
    assert all(torch.equal(r["sync"], runs[0]["sync"]) for r in runs)
    assert runs[0]["steps"] > runs[2]["steps"]  # the fast node took more inner steps


def _epochs(rank: int, world: int) -> dict:
    import time

    from engine.strategies.node_replica import NodeReplica

    out = {}
    for forced in (False, True):
        NodeReplica.EPOCHS = forced
        engine = Engine(tiny_model(0), config("diloco", 3, outer_overlap=True), mse_loss)
        replica, strategy, log = engine.strategy.replica, engine.strategy, []
        real_round, real_sum = strategy._outer_round, replica.inner_node.reduce_scatter_sum

        def outer(ctx, req, real_round=real_round, log=log):
            log.append(("start", time.monotonic()))
            time.sleep(0.3)  # a slow link: the compute side runs on meanwhile
            try:
                return real_round(ctx, req)
            finally:
                log.append(("end", time.monotonic()))

        def node_sum(*a, real_sum=real_sum, log=log):
            log.append(("node", time.monotonic()))
            return real_sum(*a)
        strategy._outer_round, replica.inner_node.reduce_scatter_sum = outer, node_sum
        engine.fit(iter(worker_stream(rank, K * H * 4)))
        engine.close()
        out[forced] = {"params": flat_params(engine.model), "log": log, "epochs": replica.epochs}
    NodeReplica.EPOCHS = None
    return out


def test_under_epochs_no_node_collective_runs_beside_an_outer_round():
    """The NCCL rule (node_replica.py, docs/gpu.md), forced on over gloo: with outer_overlap,
    no inner-step node collective starts while an outer round is in flight, on any rank; the
    results are the free-running run's, bit for bit."""
    runs = spawn(_epochs, 4, env=_env(2), timeout=300)
    for run in runs:
        assert run[True]["epochs"] and not run[False]["epochs"]
        assert torch.equal(run[True]["params"], run[False]["params"])
        log = run[True]["log"]
        rounds = [(t, next(u for k, u in log[i:] if k == "end")) for i, (k, t) in enumerate(log) if k == "start"]
        assert len(rounds) == 3
        nodes = [t for k, t in log if k == "node"]
        assert len(nodes) == 3 * H
        assert not [t for t in nodes for a, b in rounds if a < t < b]
