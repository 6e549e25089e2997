"""optimizer='muon' with model_sharding='node' (engine/parallel/node_matrices.py): FSDP2 cuts each
hidden matrix by rows over the node's ranks; the rows are gathered to one owner in the node for
torch's Newton-Schulz and the orthogonalized rows sent back, in real gloo groups of 2 nodes x 2.

Against the float64 reference of torch's Muon + AdamW (tests/tiny.py MuonAdamW, the bound of
tests/engine/test_muon.py: Newton-Schulz runs in bfloat16) and against the same run without node
sharding (the two-level exchange): bit for bit at one micro-batch a round (FSDP2's node sum is the
unsharded run's a + b, and the owner orthogonalizes the same bfloat16 matrix), within 1e-6 at two
(FSDP2 reduce-scatters each micro-batch). The bytes the node link carries for it; a bit-exact
resume at the same layout, a resume at another number of nodes, another number of ranks per node refused."""

from __future__ import annotations

import itertools

import pytest
import torch

from acco_loco import muon
from acco_loco.matrix_layout import owners
from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from engine.parallel.node_matrices import chunk_rows
from tests.engine.test_model_sharding import whole_params
from tests.tiny import Reference, mse_loss, rel_err, worker_stream

STEPS, LR = 4, 1e-2
UNSHARDED_BOUND = {1: 0.0, 2: 1e-6}  # by micro-batches per round
pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")


def matrices_model(seed: int = 0) -> torch.nn.Module:
    """Four hidden matrices (the head 3 x 10 too: a Sequential names no head) with an uneven cut
    (3 rows -> 2, 1), two in each node's chunk, one owned by each rank of the node."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12), torch.nn.Tanh(),
                                torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    model.sharding_blocks = [model[0], model[2], model[4], model[6]]
    return model


def _cfg(strategy: str, sharding: str, k: int, steps: int = STEPS, **kw) -> EngineConfig:
    return EngineConfig(**{**dict(strategy=strategy, optimizer="muon", lr=LR, weight_decay=0.1, micro_batches=k,
                                  accumulation="fixed", max_steps=steps, align=8, topology="two_level",
                                  model_sharding=sharding), **kw})


def _fit(cfg: EngineConfig, rank: int, k: int) -> dict:
    engine = Engine(matrices_model(), cfg, mse_loss)
    it = iter(worker_stream(rank, 3 * k * (STEPS + 1)))
    snaps = []
    for _ in range(STEPS):
        engine.fit(it, steps=1)
        snaps.append(whole_params(engine.model))
    nm = engine.ctx.node_matrices
    out = {"snaps": snaps, "intra": [h["wire_bytes_intra"] for h in engine.history],
           "norms": [h["grad_norm"] for h in engine.history],
           "owners": None if nm is None else (nm.owner, [(b.rows, b.cols, b.whole_rows) for b in nm.blocks])}
    engine.close()
    return out


CLIP = {"max_grad_norm": 0.05}  # below every step's norm: the exchanged rows are the clipped gradient's
RUNS = [  # (name, strategy, micro-batches a round, sharding, extra settings)
    ("zero1", "zero1", 1, "node", {}), ("zero1", "zero1", 1, "none", {}),
    ("acco", "acco", 2, "node", {}), ("acco", "acco", 2, "none", {}),
    ("acco 3 pieces", "acco", 2, "node", {"comm_chunks": 3}),  # pieces cut through the matrices
    ("acco clipped", "acco", 2, "node", CLIP), ("acco clipped", "acco", 2, "none", CLIP),
    ("dpu", "dpu", 2, "node", {}), ("dpu", "dpu", 2, "none", {}),
    ("zero1 adamw", "zero1", 1, "node", {"optimizer": "adamw"}),  # the bytes without the matrix exchange
]
UNSHARDED = {"acco 3 pieces": "acco"}  # the unsharded run a node-sharded one is compared with (else its name's)


def _runs(rank: int, world: int) -> dict:
    return {(name, sharding): _fit(_cfg(strategy, sharding, k, **kw), rank, k)
            for name, strategy, k, sharding, kw in RUNS}


def _exchange_bytes(owned_by: list[int], blocks: list[tuple[int, int, int]], local: int) -> int:
    """What rank ``local`` sends on the node link in one Muon round: its bfloat16 rows of the
    matrices others own, and the rows it orthogonalized for the others of those it owns."""
    return sum(2 * cols * (whole - rows if o == local else rows) for o, (rows, cols, whole) in zip(owned_by, blocks))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_node_sharded_muon_matches_the_reference_and_the_unsharded_run():
    runs = spawn(_runs, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=900)
    streams = {k: [worker_stream(r, 3 * k * (STEPS + 1)) for r in range(4)] for k in (1, 2)}
    for name, strategy, k, sharding, kw in RUNS:
        got = [r[(name, sharding)]["snaps"] for r in runs]
        for step in range(STEPS):  # every rank of every node holds the same parameters
            assert all(torch.equal(g[step], got[0][step]) for g in got), (name, sharding, step)
        if sharding != "node" or "optimizer" in kw:
            continue
        plain = runs[0][(UNSHARDED.get(name, name), "none")]["snaps"]
        to_unsharded = [rel_err(got[0][step], plain[step]) for step in range(STEPS)]
        assert max(to_unsharded) <= UNSHARDED_BOUND[k], (name, to_unsharded)
        if kw is CLIP:  # (the reference does not clip)
            assert min(runs[0][(name, sharding)]["norms"]) > CLIP["max_grad_norm"]
            print(f"{name} (k={k}): {max(to_unsharded):.2e} to the unsharded two-level run")
            continue
        want = Reference(matrices_model(), streams[k], k, opt="muon", lr=LR, weight_decay=0.1).run(strategy, STEPS)
        to_reference = [rel_err(got[0][step], want[step]) for step in range(STEPS)]
        print(f"{name} (k={k}): largest relative difference over {STEPS} steps: {max(to_reference):.2e} to the "
              f"float64 reference, {max(to_unsharded):.2e} to the unsharded two-level run")  # docs/acco_delay.md
        assert max(to_reference) < 1e-5, (name, to_reference)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][("acco 3 pieces", "node")]["snaps"],
                                                 runs[0][("acco", "node")]["snaps"]))
    for rank, r in enumerate(runs):
        owned_by, blocks = r[("zero1", "node")]["owners"]
        assert len(blocks) == 2 and sorted(owned_by) == [0, 1]  # each rank of the node owns a matrix
        extra = [a - b for a, b in zip(r[("zero1", "node")]["intra"], r[("zero1 adamw", "node")]["intra"])]
        assert extra == [_exchange_bytes(owned_by, blocks, rank % 2)] * STEPS, (rank, extra)
        print(f"rank {rank}: owners {owned_by}, node-link bytes a zero1 step for the matrices: {extra[0]}")


# topology 'auto': 1 node of 2 (the refused resume) has no two-level exchange
CODECS = dict(codec="loco4", param_codec="int8", group_size=8, topology="auto")


def _resume(rank: int, world: int, directory: str):
    cfg = CODECS
    stream = worker_stream(rank, 100)
    straight = Engine(matrices_model(), _cfg("acco", "node", 1, steps=6, **cfg), mse_loss)
    straight.fit(iter(stream))
    want, losses = whole_params(straight.model), [h["loss"] for h in straight.history]
    straight.close()
    first = Engine(matrices_model(), _cfg("acco", "node", 1, steps=3, **cfg), mse_loss)
    first.fit(iter(stream))
    first.save(directory)
    first.close()
    model = matrices_model(seed=7)
    resumed = Engine.load(directory, model, _cfg("acco", "node", 1, steps=6, **cfg), mse_loss)
    resumed.fit(itertools.islice(stream, resumed.consumed, None))
    got = whole_params(model)
    resumed.close()
    return torch.equal(got, want), losses


def _other_nodes(rank: int, world: int, directory: str) -> dict:
    """Resumed at this layout (1 node of 2: re-cut, tests/engine/test_muon_node_recut.py checks its
    values), or refused (2 nodes of 1 rank: the local shards are cut by the node's ranks)."""
    try:
        engine = Engine.load(directory, matrices_model(seed=7), _cfg("acco", "node", 1, steps=6, **CODECS), mse_loss)
    except ValueError as exc:
        return {"refused": str(exc)}
    history = engine.fit(iter(worker_stream(rank, 100)))
    out = {"refused": None, "step": engine.step, "losses": [h["loss"] for h in history],
           "params": whole_params(engine.model)}
    engine.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_node_sharded_muon_resumes_bit_exact_and_at_another_number_of_nodes_not_ranks_per_node(tmp_path):
    directory = str(tmp_path / "ckpt")
    runs = spawn(_resume, 4, directory, env={"LOCAL_WORLD_SIZE": "2"}, timeout=900)
    assert all(exact for exact, _ in runs)
    losses = runs[0][1]
    assert losses[-1] < losses[0]
    one_node = spawn(_other_nodes, 2, directory, env={"LOCAL_WORLD_SIZE": "2"}, timeout=300)
    for r in one_node:  # acco + LoCo-4 + int8 deltas re-cut for 1 node of 2 trains on
        assert r["refused"] is None and r["step"] == 6, r
        assert len(r["losses"]) == 3 and all(torch.isfinite(torch.tensor(r["losses"]))), r["losses"]
        assert torch.equal(r["params"], one_node[0]["params"])
    refused = spawn(_other_nodes, 2, directory, env={"LOCAL_WORLD_SIZE": "1"}, timeout=300)  # 2 nodes of 1
    assert all(r["refused"] is not None and "2 ranks per node" in r["refused"] for r in refused), refused


# ---------------------------------------------------------------- the pieces, without a process group
@pytest.mark.parametrize("strategy", ["zero1", "dpu", "acco"])
def test_the_sharded_strategies_take_muon_under_node_sharding(strategy):
    assert EngineConfig(strategy=strategy, optimizer="muon", model_sharding="node").model_sharding == "node"


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco", "local_sgd", "onebit_adam"])
def test_the_others_are_refused_naming_what_runs_it(strategy):
    with pytest.raises(ValueError, match=f"optimizer='muon' with strategy '{strategy}'.*use zero1, dpu or acco"):
        EngineConfig(strategy=strategy, optimizer="muon", model_sharding="node")


def test_torch_newton_schulz_takes_bfloat16_rows_as_it_takes_fp32():
    """The rows travel in bfloat16 (acco_loco/muon.py NS_INPUT_DTYPE): the same bits only while
    torch's Newton-Schulz casts its input to bfloat16 first."""
    spec = EngineConfig(optimizer="muon").optimizer_spec()
    for shape in ((12, 16), (16, 6), (3, 10)):
        update = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        whole = muon.orthogonalize(update, spec)
        assert torch.equal(muon.orthogonalize(update.to(muon.NS_INPUT_DTYPE), spec), whole)
        assert whole.dtype == muon.NS_INPUT_DTYPE  # what the owner sends back


def test_each_rank_of_a_node_owns_matrices_balanced_by_size():
    assert owners([100, 60, 50, 10], 2) == [0, 1, 1, 0]  # 110 / 110
    assert owners([7], 3) == [0] and owners([], 2) == []
    loads = [0, 0, 0]
    sizes = [96, 48, 300, 64, 64, 5, 700]
    for size, o in zip(sizes, owners(sizes, 3)):
        loads[o] += size
    assert max(loads) - min(loads) <= max(sizes)
    with pytest.raises(ValueError, match="at least one"):
        owners([1], 0)


@pytest.mark.parametrize("rows,g", [(16, 2), (3, 2), (10, 3), (2, 4), (1, 3)])
def test_the_rows_of_each_rank_are_torch_chunks(rows, g):
    chunks = torch.chunk(torch.zeros(rows, 2), g, dim=0)
    assert [chunk_rows(rows, g, j) for j in range(g)] == [c.shape[0] for c in chunks] + [0] * (g - len(chunks))
