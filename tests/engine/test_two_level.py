"""The two-level exchange (engine/parallel/two_level.py) in real gloo groups laid out as M nodes x G ranks:
the float64 reference of each sharded strategy, the compressed reduce-scatter against the node's
dequantized sum per rail slice, the equivalence with a flat run of M workers that each run their
node's micro-batches, bytes per link class against docs/nodes.md, bit-identical
replicas, a bit-exact resume and the errors at start."""

from __future__ import annotations

import itertools

import pytest
import torch

from acco_loco.registry import GradCodecSpec, make_codec
from engine import Engine, EngineConfig
from engine.parallel.collectives import CompressedGrads
from engine.parallel.dims import ParallelDims
from engine.parallel.local_group import spawn
from engine.parallel.topology import Layout
from engine.parallel.two_level import TwoLevelGrads
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

LAYOUTS = [(2, 2), (2, 3), (3, 2)]
STEPS, K = 6, 2


def _env(g: int) -> dict:
    return {"LOCAL_WORLD_SIZE": str(g)}


def wide_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 512), torch.nn.Tanh(), torch.nn.Linear(512, 3))


# ---------------------------------------------------------------- sharded strategies, no codec
def _strategies(rank: int, world: int, step_copy: str = "auto"):
    out = {}
    for strategy in ("zero1", "dpu", "acco"):
        model = tiny_model(seed=0)
        cfg = EngineConfig(strategy=strategy, lr=1e-2, weight_decay=0.1, micro_batches=K, accumulation="fixed",
                           max_steps=STEPS, align=8, topology="two_level", comm_chunks=2 if strategy == "acco" else 1,
                           step_copy=step_copy)
        engine = Engine(model, cfg, mse_loss)
        assert engine.topology == "two_level"
        it = iter(worker_stream(rank, 3 * K * (STEPS + 1)))
        snaps = []
        for _ in range(STEPS):
            engine.fit(it, steps=1)
            snaps.append(flat_params(model))
        engine.close()
        out[strategy] = snaps
    return out


@pytest.mark.parametrize("m,g", LAYOUTS)
def test_sharded_strategies_match_the_float64_reference(m, g):
    _check_reference(spawn(_strategies, m * g, env=_env(g)), m, g)


def test_piece_scratch_under_two_level_matches_the_float64_reference():
    """step_copy='piece' through the rail's gatherer: the scratch's pieces and the step recomputed at install."""
    _check_reference(spawn(_strategies, 4, "piece", env=_env(2)), 2, 2)


def _check_reference(results, m: int, g: int) -> None:
    world = m * g
    for strategy in ("zero1", "dpu", "acco"):
        streams = [worker_stream(r, 3 * K * (STEPS + 1)) for r in range(world)]
        want = Reference(tiny_model(seed=0), streams, K, lr=1e-2, weight_decay=0.1).run(strategy, STEPS)
        for step in range(STEPS):
            mine = results[0][strategy][step]
            for r in range(1, world):  # every replica on every node bit-identical
                assert torch.equal(results[r][strategy][step], mine), (strategy, step, r)
            # float32 summation order differs from flat (node sums first): the same bound as flat
            assert rel_err(mine, want[step]) < 1e-6, (strategy, step)


# ---------------------------------------------------------------- the compressed reduce-scatter
NUMEL, GROUP = 12 * 1024, 128


def _full(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(NUMEL, generator=g) * (1 + rank)


def _reduce(rank: int, world: int, m: int, g: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    layout = Layout(nodes=m, ranks_per_node=g, node=rank // g, local=rank % g)
    dims = ParallelDims(layout, "two_level", rank, world, torch.device("cpu"))
    counter = dims.counter
    node, rail = dims.comm("node"), dims.comm("rail")
    inner = CompressedGrads(GradCodecSpec("none", "int4"), NUMEL // g, m, GROUP, "float32", 0.8, 1024, "fp32",
                            torch.device("cpu"), stochastic=False, seed=0)
    out = TwoLevelGrads(inner, node, rail, layout).reduce(None, _full(rank), count=rank + 1).sum
    return out, counter.intra, counter.inter


@pytest.mark.parametrize("m,g", LAYOUTS)
def test_compressed_reduce_scatter_compresses_the_node_sum_per_rail_slice(m, g):
    world = m * g
    results = spawn(_reduce, world, m, g)
    codec = make_codec("int4", group_size=GROUP)
    shard = NUMEL // world
    # the node's sum and count; the codec sees the node's mean of each rail slice, weighted by the count
    want = torch.zeros(NUMEL, dtype=torch.float64)
    for node in range(m):
        ranks = range(node * g, (node + 1) * g)
        node_sum = sum(_full(r).double() for r in ranks)
        count = sum(r + 1 for r in ranks)
        chunks = node_sum.view(m, g, shard)
        for local in range(g):  # rank (node, local) encodes slice local: chunks node' * g + local
            payload, scales = codec.encode((chunks[:, local, :].reshape(-1) / count).float())
            deq = codec.decode(payload, scales).double().view(m, shard)
            want.view(m, g, shard)[:, local, :] += count * deq
    exact = sum(_full(r).double() for r in range(world))
    for r, (got, intra, inter) in enumerate(results):
        torch.testing.assert_close(got.double(), want[r * shard:(r + 1) * shard], rtol=0, atol=2e-4)
        # the node's reduce-scatter: G-1 slices of P/G fp32 values and the count's all-reduce
        assert intra == (g - 1) * (NUMEL // g) * 4 + 2 * (g - 1) * 8 // g
        # the rail: M-1 rows of one shard's payload, fp32 scales and the node's count
        assert inter == (m - 1) * (shard * 4 // 8 + shard // GROUP * 4 + 4)
    assert (want - exact).norm() / exact.norm() < 0.2  # a real approximation of the sum


# ---------------------------------------------------------------- codecs in the engine
def _codec_run(rank: int, world: int, topology: str, micro_batches: int, merged_from: int, steps: int = 5):
    """acco + loco4 + int4 deltas; a flat run of M workers reads, each round, the micro-batches
    of the ``merged_from`` ranks of its node in rank order (what the node's sum adds up)."""
    model = wide_model()
    cfg = EngineConfig(strategy="acco", codec="loco4", param_codec="int4", lr=3e-3, micro_batches=micro_batches,
                       accumulation="fixed", max_steps=steps, topology=topology)
    engine = Engine(model, cfg, mse_loss)
    k = micro_batches // merged_from
    streams = [worker_stream(rank * merged_from + j, 200) for j in range(merged_from)]
    stream = [b for r in range(60) for s in streams for b in s[r * k:(r + 1) * k]]
    history = engine.fit(iter(stream))
    engine.close()
    return flat_params(model), history, engine.topology


@pytest.mark.parametrize("m,g", [(2, 2), (3, 2)])
def test_two_level_codecs_equal_a_flat_run_of_the_nodes(m, g):
    two = spawn(_codec_run, m * g, "two_level", K, 1, env=_env(g))
    flat = spawn(_codec_run, m, "flat", g * K, g)  # one rank per node: the node's micro-batches
    assert two[0][2] == "two_level" and flat[0][2] == "flat"
    for r in range(1, m * g):
        assert torch.equal(two[r][0], two[0][0]), r
    for r in range(1, m):
        assert torch.equal(flat[r][0], flat[0][0]), r
    # the same quantized values up to float32 summation order of the node's sum
    assert rel_err(two[0][0], flat[0][0]) < 1e-3
    # and the codecs are at work (an uncompressed run lands elsewhere)
    plain = Reference(wide_model(), [worker_stream(r, 200) for r in range(m * g)], K, lr=3e-3,
                      weight_decay=0.0).run("acco", 5)[-1]
    assert rel_err(two[0][0], plain.float()) > 1e-3
    losses = [h["loss"] for h in two[0][1]]
    assert losses[-1] < losses[0]


def _bytes_run(rank: int, world: int, topology: str):
    model = wide_model()
    cfg = EngineConfig(strategy="acco", codec="loco4", param_codec="int4", lr=3e-3, micro_batches=1,
                       accumulation="fixed", max_steps=3, topology=topology)
    engine = Engine(model, cfg, mse_loss)
    history = engine.fit(iter(worker_stream(rank, 50)))
    engine.close()
    return [(h["wire_bytes"], h["wire_bytes_intra"], h["wire_bytes_inter"]) for h in history], engine.flat.padded


def test_bytes_per_link_class_equal_the_formula_and_halve_the_node_link():
    m, g = 2, 2
    n = m * g
    two = spawn(_bytes_run, n, "two_level", env=_env(g))
    flat = spawn(_bytes_run, n, "flat", env=_env(g))
    padded = two[0][1]
    shard, group = padded // n, 128
    row = shard // 2 + shard // group * 4  # int4 payload + fp32 scales of one shard
    small = (4 + 3 * n) * 8  # the round's small all-reduce (docs/design/rounds.md)
    # per round, docs/nodes.md; acco runs two rounds per step
    inter_two = (m - 1) * (row + 4) + (m - 1) * row + 2 * (n - g) * small // n
    intra_two = ((g - 1) * (padded // g) * 4 + 2 * (g - 1) * 8 // g      # node reduce-scatter + count
                 + (g - 1) * (padded // g) * 4 + 2 * (g - 1) * n * 8 // g  # node all-gather + flags
                 + 2 * (g - 1) * small // n)
    inter_flat = (n - g) * (row + 4) + (n - g) * row + 2 * (n - g) * small // n
    for r in range(n):
        for total, intra, inter in two[r][0]:
            assert (intra, inter) == (2 * intra_two, 2 * inter_two)
            assert total == intra + inter
        for total, intra, inter in flat[r][0]:
            assert inter == 2 * inter_flat and total == intra + inter
    # the node's link carries 1/G of the flat exchange's bytes (and the small all-reduce)
    assert two[0][0][-1][2] <= 0.55 * flat[0][0][-1][2]


def _onebit_run(rank: int, world: int, topology: str, micro_batches: int, merged_from: int):
    """1-bit Adam (3 AdamW warmup steps, then 1-bit momentum); a flat run reads as _codec_run."""
    model = wide_model()
    cfg = EngineConfig(strategy="onebit_adam", lr=3e-3, micro_batches=micro_batches, accumulation="fixed",
                       max_steps=8, topology=topology, onebit_warmup_steps=3)
    engine = Engine(model, cfg, mse_loss)
    k = micro_batches // merged_from
    streams = [worker_stream(rank * merged_from + j, 200) for j in range(merged_from)]
    history = engine.fit(iter([b for r in range(60) for s in streams for b in s[r * k:(r + 1) * k]]))
    engine.close()
    return flat_params(model), [h["loss"] for h in history], engine.topology


def test_onebit_adam_two_level_is_a_node_per_worker():
    """A node is one 1-bit Adam worker: two-level at 2 x 2 equals a flat run of 2 workers that
    run their node's micro-batches (the same sign bits; float32 summation order apart)."""
    two = spawn(_onebit_run, 4, "two_level", K, 1, env=_env(2))
    flat = spawn(_onebit_run, 2, "flat", 2 * K, 2)
    assert two[0][2] == "two_level"
    for r in range(1, 4):
        assert torch.equal(two[r][0], two[0][0]), r
    assert rel_err(two[0][0], flat[0][0]) < 1e-6
    assert two[0][1][-1] < two[0][1][0]


# ---------------------------------------------------------------- resume, errors
def _resume(rank: int, world: int, directory: str, kw: dict):
    def cfg(steps):
        return EngineConfig(lr=3e-3, micro_batches=1, accumulation="fixed", max_steps=steps, topology="two_level",
                            **kw)

    stream = worker_stream(rank, 100)
    straight = Engine(wide_model(), cfg(8), mse_loss)
    straight.fit(iter(stream))
    straight.close()
    first = Engine(wide_model(), cfg(4), mse_loss)
    first.fit(iter(stream))
    first.save(directory)
    first.close()
    model = wide_model(seed=7)
    resumed = Engine.load(directory, model, cfg(8), mse_loss)
    resumed.fit(itertools.islice(stream, resumed.consumed, None))
    resumed.close()
    return torch.equal(flat_params(model), flat_params(straight.model))


@pytest.mark.parametrize("kw", [
    {"strategy": "acco", "codec": "loco4", "param_codec": "int8", "reset_period": 3},
    {"strategy": "onebit_adam", "onebit_warmup_steps": 2, "param_codec": "bfloat16"},  # resumed in its 1-bit phase
])
def test_resume_is_bit_exact_under_two_level(tmp_path, kw):
    assert all(spawn(_resume, 4, str(tmp_path / "ckpt"), kw, env=_env(2)))


def _build(rank: int, world: int, kw: dict, per_rank: dict | None = None):
    kw = {**kw, **(per_rank or {}).get(rank, {})}
    Engine(tiny_model(), EngineConfig(max_steps=2, align=8, timeout_s=30, heartbeat_s=1, **kw), mse_loss)


@pytest.mark.parametrize("kw,per_rank,env,match", [
    ({"topology": "two_level"}, None, {}, "needs at least 2 nodes"),
    ({"ranks_per_node": 3}, None, {}, "cannot be split into nodes of 3"),
    ({}, {1: {"ranks_per_node": 2}}, {}, "disagree on the ranks per node"),
    ({"topology": "two_level", "strategy": "local_sgd", "optimizer": "sgd", "momentum": 0.0}, None, _env(2),
     "no two-level exchange yet"),
])
def test_clear_errors_on_every_rank(kw, per_rank, env, match):
    # every rank raises (none waits for a peer that already gave up): spawn reports each
    errors = spawn_errors(_build, 4, kw, per_rank, env)
    assert len(errors) == 4 and all(match in e for e in errors), errors


def spawn_errors(fn, world, kw, per_rank, env) -> list[str]:
    try:
        spawn(fn, world, kw, per_rank, timeout=60, env=env)
    except AssertionError as exc:
        return [line for line in str(exc).splitlines() if line.startswith("rank ")]
    return []


# ---------------------------------------------------------------- heterogeneous nodes
TOTAL = 15  # global micro-batches per step: acco's rounds take 7 and 8, at least one per rank


def _hetero(rank: int, world: int, strategy: str):
    from engine import GlobalBatches

    def loss_fn(model, batch):  # node 1 (ranks 2, 3) sleeps 10x longer: speed shares move work off it
        import time

        # the sleeps, not the tiny model, set the speeds: long enough that a loaded machine's
        # compute (the same on every rank) does not even them out
        time.sleep(0.030 if rank >= 2 else 0.003)
        return mse_loss(model, batch)

    cfg = EngineConfig(strategy=strategy, lr=1e-2, global_micro_batches=TOTAL, balance="speed", max_steps=STEPS,
                       align=8, topology="two_level")
    engine = Engine(tiny_model(0), cfg, loss_fn)
    history = engine.fit(GlobalBatches(worker_stream(7, 400)))
    engine.close()
    return {"params": flat_params(engine.model), "round_counts": engine.round_counts,
            "samples": [h["samples"] for h in history]}


@pytest.mark.parametrize("strategy", ["zero1", "acco"])
def test_heterogeneous_nodes_keep_the_global_batch_and_the_reference(strategy):
    from engine.batch.dealing import dealt_index

    rounds = 2 if strategy == "acco" else 1
    run = spawn(_hetero, 4, strategy, env=_env(2))
    late = [sum(p["round_counts"][-3:]) for p in run]
    # the fast node took the work: of the last 3 steps' micro-batches, at least 1.5x the slow node's
    # (idle, 10x the speed gives about 6x; a load average of 8-12 on 2 cores once gave 13 against 10
    # with the old 8x sleeps of 2 and 16 ms)
    assert sum(late[:2]) >= 1.5 * sum(late[2:]), late
    assert run[0]["samples"] == [TOTAL * 4] * STEPS  # the step's batch is the user's number
    data = worker_stream(7, 400)
    streams = [[] for _ in range(4)]
    for r in range(len(run[0]["round_counts"])):
        shares = [p["round_counts"][r] for p in run]
        for w in range(4):
            streams[w] += [data[dealt_index(r, i, w, shares, TOTAL, rounds)] for i in range(shares[w])]
    counts = [p["round_counts"] for p in run]
    want = Reference(tiny_model(0), streams, k=1, lr=1e-2, round_counts=counts, weight_decay=0.0).run(strategy, STEPS)
    for p in run:
        assert torch.equal(p["params"], run[0]["params"])
    assert rel_err(run[0]["params"], want[-1]) < 1e-6


def _save_two_level(rank: int, world: int, directory: str):
    engine = Engine(tiny_model(0), EngineConfig(strategy="zero1", codec="loco4", lr=1e-2, micro_batches=1,
                                                accumulation="fixed", max_steps=2, align=8, group_size=8,
                                                topology="two_level"), mse_loss)
    engine.fit(iter(worker_stream(rank, 10)))
    engine.save(directory)
    engine.close()


def _load_flat(rank: int, world: int, directory: str):
    cfg = EngineConfig(strategy="zero1", codec="loco4", lr=1e-2, micro_batches=1, accumulation="fixed",
                       max_steps=4, align=8, group_size=8)
    Engine.load(directory, tiny_model(0), cfg, mse_loss)


def test_a_two_level_checkpoint_refuses_another_world_size_clearly(tmp_path):
    spawn(_save_two_level, 4, str(tmp_path / "c"), env=_env(2))
    with pytest.raises(AssertionError, match="under the two-level exchange on one side"):
        spawn(_load_flat, 2, str(tmp_path / "c"))
