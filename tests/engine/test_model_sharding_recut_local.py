"""diloco, sparseloco and local_sgd with model_sharding='node' resumed at another number of nodes
(engine/checkpoint/reshard.py ``recut_rails``; issue 41).

Each rank (m, l) keeps its FSDP2 local shards' state: the inner AdamW state of node m's replica
(``Recut("local")``), theta_sync and the outer momentum (alike on every node, "shared"), sparseloco's
error feedback (summed), local_sgd's replica parameters (local). A 2 nodes x 2 ranks checkpoint at
a period boundary is resumed at 1 x 2 and 3 x 2. The reference is the flat re-cut's rules
(``apply_rule``, the unsharded code path) applied to the same checkpoint's state taken whole: each
node's tensors gathered over its ranks into the model's values in model order, what an unsharded
run of one worker per node holds. Every state tensor the resumed run holds, gathered whole the same
way, must equal that reference value for value on every node, and the model it runs on must be its
own inner master. The runs then train on (finite losses, the nodes meeting at the next round).

A checkpoint taken with an outer round in flight (outer_overlap) is refused with recut_refusal's
error on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import Engine, EngineConfig
from engine.checkpoint.recut_matrices import ModelOrder
from engine.checkpoint.reshard import apply_rule
from engine.parallel.local_group import spawn
from engine.strategies.local_steps import LocalStepStrategy
from tests.engine.test_local_steps_sharded import CHUNK, H, chunked_model, config
from tests.engine.test_model_sharding import whole_params
from tests.tiny import mse_loss, worker_stream

G = 2  # ranks per node, kept: the local shards are cut by them
PERIOD = 4  # local_sgd's steps between averages (engine/strategies/local_sgd.py)
# what each keeps laid out as its local shards (the optimizer state of local_sgd is its parameters)
KEPT = {"diloco": {"opt.master", "opt.exp_avg", "opt.exp_avg_sq", "outer.theta_sync", "outer.momentum"},
        "sparseloco": {"opt.master", "opt.exp_avg", "opt.exp_avg_sq", "outer.theta_sync", "outer.error"},
        "local_sgd": {"local_params"}}
CASES = {
    "diloco": ("diloco", {"outer_momentum": 0.9}),
    "sparseloco-cpu-offload": ("sparseloco", {"outer_state_device": "cpu", "optimizer_offload": "cpu"}),
    "local_sgd-offload": ("local_sgd", {"optimizer_offload": "cpu"}),
}


def _cfg(strategy: str, steps: int, kw: dict) -> EngineConfig:
    if strategy == "local_sgd":
        return EngineConfig(strategy="local_sgd", optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=1e-2,
                            micro_batches=1, accumulation="fixed", max_steps=steps, align=CHUNK,
                            model_sharding="node", **kw)
    return config(strategy, "node", 1, rounds=steps // H, topology="auto", **kw)


def _period(strategy: str) -> int:
    return PERIOD if strategy == "local_sgd" else H


def whole_state(engine) -> dict[str, torch.Tensor]:
    """Every tensor of the rank's checkpoint state that is laid out as its local shards, gathered
    over the node into the model's values (a node collective: every rank of the node calls it).
    Not local_sgd's optimizer shard (``Recut("shard")``, a chunk of the rail's buffer: its SGD state
    is the replica's parameters, ``local_params``), the pending gradient (dropped) nor the RNG."""
    tensors, _ = engine.state_dict()
    keep = [k for k in sorted(tensors) if k != "pending_grad" and not k.startswith("rng_")
            and engine.strategy.recut_rule(k).rule != "shard"]
    assert all(tensors[k].numel() == engine.flat.padded for k in keep), keep
    return {k: LocalStepStrategy._gather_local_shards(engine.ctx, tensors[k].to(torch.float32)) for k in keep}


def _save(rank: int, world: int, root: str):
    out = {}
    for name, (strategy, kw) in CASES.items():
        engine = Engine(chunked_model(), _cfg(strategy, 2 * _period(strategy), kw), mse_loss)
        engine.fit(iter(worker_stream(rank, 40)), steps=_period(strategy))  # at the period's boundary
        out[name] = whole_state(engine)
        engine.save(f"{root}/{name}")
        engine.close()
    overlapped = Engine(chunked_model(), _cfg("diloco", 2 * H, {"outer_overlap": True}), mse_loss)
    overlapped.fit(iter(worker_stream(rank, 40)), steps=H)  # the round runs behind the next period
    overlapped.save(f"{root}/in-flight")
    overlapped.close()
    return out


def _resume(rank: int, world: int, root: str):
    out = {}
    for name, (strategy, kw) in CASES.items():
        period = _period(strategy)
        model = chunked_model(seed=7)
        engine = Engine.load(f"{root}/{name}", model, _cfg(strategy, 3 * period, kw), mse_loss)
        state, params = whole_state(engine), whole_params(model)
        history = engine.fit(itertools.islice(iter(worker_stream(rank, 40)), engine.consumed, None), steps=period)
        sync = engine.strategy.whole_theta_sync(engine.ctx) if strategy != "local_sgd" else whole_params(model)
        out[name] = {"state": state, "params": params, "losses": [h["loss"] for h in history],
                     "after": sync[:params.numel()].clone()}
        engine.close()
    try:
        Engine.load(f"{root}/in-flight", chunked_model(), _cfg("diloco", 3 * H, {"outer_overlap": True}), mse_loss)
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def _check(saved: list[dict], resumed: list[dict], nodes: int) -> None:
    from engine.strategies import strategy_class

    for name, (strategy, _) in CASES.items():
        rules = strategy_class(strategy)
        old = [saved[m * G][name] for m in range(len(saved) // G)]  # node m's whole state (rank (m, 0)'s)
        for r in range(len(saved)):  # the ranks of a node gathered the same whole values
            assert all(torch.equal(saved[r][name][k], old[r // G][k]) for k in old[0]), (name, r)
        numel = old[0][next(iter(old[0]))].numel()
        for r, run in enumerate(resumed):
            node = r // G
            got = run[name]["state"]
            assert set(got) == set(old[0]) == KEPT[strategy], (name, sorted(got), sorted(old[0]))
            for key in got:  # the flat rules on the whole state, for node ``node`` of ``nodes``
                want, _ = apply_rule(rules.recut_rule(key), key, old, ModelOrder(numel, numel), numel, node, nodes)
                assert torch.equal(got[key], want), (name, key, r, (got[key] - want).abs().max())
            own = got["local_params" if strategy == "local_sgd" else "opt.master"]
            assert torch.equal(run[name]["params"], own[:run[name]["params"].numel()]), (name, r)
            losses = torch.tensor(run[name]["losses"])
            assert losses.numel() == _period(strategy) and torch.isfinite(losses).all(), (name, r, losses)
            assert run[name]["losses"] == resumed[node * G][name]["losses"]  # one replica per node
            assert torch.equal(run[name]["after"], resumed[0][name]["after"]), (name, r)  # met at the round
        if nodes > len(old):  # a new node starts from theta_sync (local_sgd: node 0's parameters)
            first = "local_params" if strategy == "local_sgd" else "outer.theta_sync"
            own = "local_params" if strategy == "local_sgd" else "opt.master"
            assert torch.equal(resumed[len(old) * G][name]["state"][own], old[0][first]), name
        if strategy == "sparseloco":  # the error feedback's sum over the nodes is kept
            total = sum(o["outer.error"].double() for o in old)
            spread = sum(resumed[m * G][name]["state"]["outer.error"].double() for m in range(nodes))
            assert total.abs().max() > 0 and torch.allclose(spread, total, rtol=1e-6, atol=1e-7)
    for run in resumed:
        assert run["refused"] is not None and "outer round in flight" in run["refused"], run["refused"]
        assert f"cannot be re-cut for {nodes} nodes" in run["refused"] and "Resume it with 2 nodes" in run["refused"]


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    """The 2 nodes x 2 ranks checkpoints and every rank's state gathered whole when they were saved."""
    root = str(tmp_path_factory.mktemp("recut_local"))
    return root, spawn(_save, 4, root, env={"LOCAL_WORLD_SIZE": str(G)}, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_node_sharded_local_steps_are_recut_for_1_node(saved_2x2):
    root, saved = saved_2x2
    _check(saved, spawn(_resume, G, root, env={"LOCAL_WORLD_SIZE": str(G)}, timeout=600), 1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_node_sharded_local_steps_are_recut_for_3_nodes(saved_2x2):
    root, saved = saved_2x2
    _check(saved, spawn(_resume, 3 * G, root, env={"LOCAL_WORLD_SIZE": str(G)}, timeout=600), 3)
