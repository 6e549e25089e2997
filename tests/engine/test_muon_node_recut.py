"""optimizer='muon' with model_sharding='node' resumed at another number of nodes (issue 43;
engine/checkpoint/reshard.py ``recut_rails`` through recut_matrices.py ``MatrixOrder``).

Rank (m, l) holds chunk m of rail l's local buffer (engine/core/flat.py ``LocalShards``), where each
parameter sits in a slot placed for the number of nodes M (acco_loco/matrix_layout.py), holding local
rank l's rows. A 2 nodes x 2 ranks zero1 or acco run saves after 3 steps; it resumes at 2 x 2 (the
reference), 1 x 2 and 3 x 2 for 3 more steps on the same global micro-batches (GlobalBatches).
Checked: each rail's master, Muon momentum and AdamW moments, read in the rail's model order, equal
the saved ones value for value, and the continuation's parameters are within 1e-6 relative of the
reference (a node's sum of micro-batches, FSDP2's reduce-scatter, is added in another order with
another number of them a rank). ACCO's reference is the checkpoint re-cut for its own 2 x 2 (its
pending round is dealt again by a re-cut, by design; tests/engine/test_muon_recut.py). Another
number of ranks per node stays refused (tests/engine/test_muon_node_sharded.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import Engine, EngineConfig
from engine.batch.dealing import GlobalBatches
from engine.parallel.local_group import spawn
from tests.engine.test_model_sharding import whole_params
from tests.engine.test_muon_node_sharded import matrices_model
from tests.engine.test_muon_recut import recut_at_own_world_size
from tests.tiny import mse_loss, rel_err, worker_stream

G, SAVED_AT, MORE, LR = 2, 3, 3, 1e-2
DATA = worker_stream(0, 200)  # the global micro-batches, the same for every number of nodes
CASES = {"zero1": "zero1", "acco": "acco"}
GLOBAL = 12  # a round: whole units of G micro-batches for 1, 2 and 3 nodes (acco: two rounds of 6)
KEYS = ("master", "exp_avg", "exp_avg_sq")
pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")


def _cfg(strategy: str, steps: int) -> EngineConfig:
    return EngineConfig(strategy=strategy, optimizer="muon", lr=LR, weight_decay=0.1, global_micro_batches=GLOBAL,
                        accumulation="fixed", max_steps=steps, align=8, topology="auto", model_sharding="node")


def _state(engine) -> dict:
    s = engine.shard_state
    return {**{k: getattr(s, k).clone() for k in KEYS}, "offsets": list(engine.flat.offsets)}


def _save(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, strategy in CASES.items():
        engine = Engine(matrices_model(), _cfg(strategy, SAVED_AT), mse_loss)
        engine.fit(GlobalBatches(DATA))
        engine.save(f"{root}/{name}")
        out[name] = _state(engine)
        engine.close()
    return out


def _resume(rank: int, world: int, root: str, by_recut: tuple = ()) -> dict:
    from engine.checkpoint.load import OpenCheckpoint

    own = OpenCheckpoint.rank_state
    out = {}
    try:
        for name, strategy in CASES.items():
            OpenCheckpoint.rank_state = own
            if name in by_recut:
                recut_at_own_world_size(OpenCheckpoint)
            model = matrices_model(seed=5)  # every value comes from the checkpoint
            engine = Engine.load(f"{root}/{name}", model, _cfg(strategy, SAVED_AT + MORE), mse_loss)
            loaded, start = _state(engine), whole_params(model)
            engine.fit(GlobalBatches(DATA))
            out[name] = {"loaded": loaded, "start": start, "params": whole_params(model), "step": engine.step}
            engine.close()
    finally:
        OpenCheckpoint.rank_state = own
    return out


def rail_values(states: list[dict], key: str, local: int) -> torch.Tensor:
    """Rail ``local``'s tensor ``key`` in its model order: the nodes' chunks (ranks m G + local)
    joined into the local buffer, each local shard read at its offset."""
    rail = states[local::G]
    buffer = torch.cat([s[key] for s in rail])
    return torch.cat([buffer[a:b] for a, b in rail[0]["offsets"]])


def _check(saved: list[dict], reference: list[dict], resumed: list[dict], bound: float) -> None:
    nodes = len(resumed) // G
    for name in CASES:
        old = [s[name] for s in saved]
        new = [r[name]["loaded"] for r in resumed]
        ref = [r[name]["loaded"] for r in reference]
        assert new[0]["offsets"] != old[0]["offsets"], "the placements must differ for the re-cut to be tested"
        for local in range(G):
            for key in KEYS:  # value for value, each parameter's rows where the new run keeps them
                want = rail_values(old, key, local)
                assert torch.equal(rail_values(new, key, local), want), (name, key, local)
                assert torch.equal(rail_values(ref, key, local), want), (name, key, local)  # the reference's start
            assert rail_values(old, "exp_avg", local).abs().sum() > 0
        want = reference[0][name]["params"]
        errors = [rel_err(r[name]["params"], want) for r in resumed]
        print(f"muon node-sharded {name} 2 x {G} -> {nodes} x {G}: largest relative error against the "
              f"resume at 2 x {G}: {max(errors):.2e}")
        assert all(r[name]["step"] == SAVED_AT + MORE for r in resumed)
        assert all(torch.equal(r[name]["params"], resumed[0][name]["params"]) for r in resumed)  # one model
        assert max(errors) <= bound, (name, errors)
        assert not torch.equal(want, reference[0][name]["start"])  # the continuation moved the model


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    """The 2 x 2 checkpoints, their state when saved, and the resume at 2 x 2 (acco: re-cut for itself)."""
    root = str(tmp_path_factory.mktemp("muon_node_recut"))
    env = {"LOCAL_WORLD_SIZE": str(G)}
    saved = spawn(_save, 2 * G, root, env=env, timeout=600)
    reference = spawn(_resume, 2 * G, root, ("acco",), env=env, timeout=600)
    return root, saved, reference


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_node_sharded_muon_checkpoint_of_2_nodes_resumes_at_1(saved_2x2):
    root, saved, reference = saved_2x2
    _check(saved, reference, spawn(_resume, G, root, env={"LOCAL_WORLD_SIZE": str(G)}, timeout=600), 1e-6)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_node_sharded_muon_checkpoint_of_2_nodes_resumes_at_3(saved_2x2):
    root, saved, reference = saved_2x2
    _check(saved, reference, spawn(_resume, 3 * G, root, env={"LOCAL_WORLD_SIZE": str(G)}, timeout=600), 1e-6)


# ---------------------------------------------------------------- the rail's relayout alone, one process
def _rail_at(nodes: int, local: int):
    """What LocalShards holds for local rank ``local`` of 2 at ``nodes`` nodes: every parameter's slot
    as long as local rank 0's rows (matrices_model's 3-row head and bias: 2 rows and 1 row)."""
    from acco_loco.matrix_layout import place

    params = list(matrices_model().parameters())
    slots = [-(-p.shape[0] // G) * (p.numel() // p.shape[0]) for p in params]
    rows = [torch.chunk(p.detach(), G)[local].numel() for p in params]
    whole = [p.ndim == 2 for p in params]
    starts, shard = place(slots, whole, nodes, 8)
    return SimpleNamespace(offsets=[(a, a + n) for a, n in zip(starts, rows)], slots=slots, numel=sum(rows),
                           padded=shard * nodes, shard_size=shard,
                           matrices=sorted((a, 1, 1, 1) for a, w in zip(starts, whole) if w))


@pytest.mark.parametrize("local", range(G))
def test_matrix_order_moves_a_rails_rows_between_numbers_of_nodes(local):
    from engine.checkpoint.recut_matrices import MatrixOrder

    old, new = _rail_at(2, local), _rail_at(3, local)
    assert old.offsets != new.offsets
    values = torch.arange(1, old.numel + 1, dtype=torch.float32)  # each value its model-order index
    order = MatrixOrder(new, 2, 8)
    assert order.old_shard_size == old.shard_size
    before = torch.zeros(old.padded)
    at = 0
    for a, b in old.offsets:
        before[a:b] = values[at:at + b - a]
        at += b - a
    assert torch.equal(order.values(before), values)
    after = order.place(values, fill=-1)
    assert torch.equal(torch.cat([after[a:b] for a, b in new.offsets]), values)
    held = sum(b - a for a, b in new.offsets)
    assert int((after == -1).sum()) == new.padded - held  # slot tails and padding take the fill
    if local == 1:  # the head's 1 row of 2 leaves a tail in its slot
        assert held < sum(new.slots)
