"""diloco and sparseloco with the model sharded inside the node (model_sharding='node'; issue 41):
each rank takes the inner steps on its FSDP2 local shards (1/G of the model), the outer round runs
over the rail on them, and theta_sync, the outer momentum and the error feedback hold 1/G of the
model, on the device or on the CPU (outer_state_device). In real gloo groups of M nodes x G ranks,
against the same run without model sharding (the two-level run, a node as one replica), whose
float64 references are in tests/engine/test_node_replicas.py.

The model's every trainable weight cuts into whole top-k chunks under both layouts (the node
replica's slices of the flat buffer and FSDP2's rows), so sparseloco's chunks hold the same values
in both runs. Bit for bit at one micro-batch per rank and two ranks per node (FSDP2's node sum is
the unsharded run's a + b); else FSDP2 sums each micro-batch's gradients over the node first and the
unsharded run each rank's micro-batches first: within 1e-6."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.engine.test_model_sharding import whole_params
from tests.tiny import mse_loss, rel_err, worker_stream

H, ROUNDS, LR, WD, OUTER_LR = 3, 2, 1e-2, 0.1, 0.7
CHUNK = 16  # sparseloco's top-k chunk; align=CHUNK keeps every node replica's shard whole chunks
OWN = {"diloco": {"outer_momentum": 0.9},
       "sparseloco": {"topk_chunk": CHUNK, "topk_density": 0.25, "topk_value_bits": 2, "sparse_error_beta": 0.95}}


def chunked_model(seed: int = 0) -> torch.nn.Module:
    """Two trainable weights of 288 values each, whose rows cut over 2 or 3 ranks into whole chunks
    of 16 values (48 x 6 -> 24 or 16 rows of 6; 6 x 48 -> 3 or 2 rows of 48); the head is frozen."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 48, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(48, 6, bias=False), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model[4].requires_grad_(False)
    model.sharding_blocks = [model[0], model[2], model[4]]
    return model


def config(strategy: str, sharding: str, k: int, rounds: int = ROUNDS, **kw) -> EngineConfig:
    return EngineConfig(strategy=strategy, lr=LR, weight_decay=WD, micro_batches=k, accumulation="fixed",
                        max_steps=rounds * H, align=CHUNK, inner_steps=H, outer_lr=OUTER_LR,
                        model_sharding=sharding, **{"topology": "two_level", **OWN[strategy], **kw})


def train(rank: int, strategy: str, sharding: str, k: int, **kw) -> dict:
    engine = Engine(chunked_model(), config(strategy, sharding, k, **kw), mse_loss)
    it = iter(worker_stream(rank, k * H * (ROUNDS + 1)))
    snaps, losses = [], []
    for _ in range(ROUNDS * H):
        losses += [h["loss"] for h in engine.fit(it, steps=1)]
        snaps.append(whole_params(engine.model))
    out = {"snaps": snaps, "loss": losses, "sync": engine.strategy.whole_theta_sync(engine.ctx)[:snaps[0].numel()],
           "inner_state": engine.shard_state.master.numel(), "outer_state": engine.strategy.theta_sync.numel(),
           "outer_device": engine.strategy.theta_sync.device.type, "local": engine.flat.numel}
    engine.close()
    return out


RUNS = [(s, sharding, place, overlap) for s in ("diloco", "sparseloco")
        for sharding, place, overlap in (("none", "device", False), ("node", "device", False), ("node", "cpu", False),
                                         ("none", "device", True), ("node", "cpu", True))]


def _runs(rank: int, world: int, k: int) -> dict:
    return {run: train(rank, run[0], run[1], k, outer_state_device=run[2], outer_overlap=run[3]) for run in RUNS}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("m,g,k", [(2, 2, 1), (2, 3, 2)])
def test_sharded_local_steps_match_the_unsharded_run(m, g, k):
    world = m * g
    runs = spawn(_runs, world, k, env={"LOCAL_WORLD_SIZE": str(g)}, timeout=600)
    bound = 0.0 if (g, k) == (2, 1) else 1e-6
    whole = runs[0][RUNS[0]]["snaps"][0].numel()
    for strategy, sharding, place, overlap in RUNS:
        if sharding == "none":
            continue
        run, plain = (strategy, sharding, place, overlap), (strategy, "none", "device", overlap)
        for r in range(world):
            got, want = runs[r][run], runs[r][plain]
            first = runs[(r // g) * g][run]
            for t in range(ROUNDS * H):
                assert torch.equal(got["snaps"][t], first["snaps"][t]), (run, r, t)  # one node, one replica
                diff = rel_err(got["snaps"][t], want["snaps"][t])
                assert diff <= bound, (run, r, t, diff)
            assert torch.equal(got["sync"], runs[0][run]["sync"]), (run, r)  # theta_sync the same everywhere
            assert rel_err(got["sync"], want["sync"]) <= bound, (run, r)
            losses = torch.tensor(got["loss"], dtype=torch.float64)
            assert rel_err(losses, torch.tensor(want["loss"], dtype=torch.float64)) <= max(bound, 1e-12), (run, r)
            # the inner and the outer state hold this rank's local shards: 1/G of the model (and padding)
            assert got["inner_state"] == got["outer_state"] < whole / g + m * CHUNK, (run, r)
            assert got["outer_device"] == "cpu"
        # the device and the CPU outer state give the same bits
        if place == "cpu" and not overlap:
            for r in range(world):
                for t in range(ROUNDS * H):
                    assert torch.equal(runs[r][run]["snaps"][t], runs[r][(strategy, "node", "device", False)]["snaps"][t])
    # the local shards cover the model once per node
    assert sum(runs[r][RUNS[1]]["local"] for r in range(g)) == whole
    # the nodes go apart between rounds and meet at each round (no overlap)
    a, b = runs[0][RUNS[1]]["snaps"], runs[g][RUNS[1]]["snaps"]
    assert not torch.equal(a[H - 2], b[H - 2]) and torch.equal(a[H - 1], b[H - 1])


def _resume(rank: int, world: int, root: str) -> dict:
    out = {}
    for strategy, place, overlap in (("diloco", "device", True), ("sparseloco", "cpu", False), ("diloco", "cpu", False)):
        kw = {"outer_state_device": place, "outer_overlap": overlap}
        data = worker_stream(rank, H * (ROUNDS + 2))
        straight = Engine(chunked_model(), config(strategy, "node", 1, **kw), mse_loss)
        straight.fit(iter(data))
        want, want_sync = whole_params(straight.model), straight.strategy.theta_sync.clone()
        straight.close()
        first = Engine(chunked_model(), config(strategy, "node", 1, **kw), mse_loss)
        first.fit(iter(data), steps=H + 1)  # mid-period, after a round (in flight with overlap)
        path = f"{root}/{strategy}-{place}-{overlap}"
        first.save(path)
        first.close()
        model = chunked_model(seed=7)
        resumed = Engine.load(path, model, config(strategy, "node", 1, **kw), mse_loss)
        resumed.fit(itertools.islice(iter(data), resumed.consumed, None))
        out[strategy, place, overlap] = (torch.equal(whole_params(model), want),
                                         torch.equal(resumed.strategy.theta_sync, want_sync))
        resumed.close()
    return out


@pytest.mark.slow
def test_sharded_local_steps_resume_bit_exact(tmp_path):
    runs = spawn(_resume, 4, str(tmp_path), env={"LOCAL_WORLD_SIZE": "2"}, timeout=300)
    for r, run in enumerate(runs):
        for key, (params, sync) in run.items():
            assert params and sync, (r, key)


def _refused(rank: int, world: int) -> str:
    try:
        Engine(chunked_model(), config("sparseloco", "node", 1, topology="auto", topk_layout="tensor"), mse_loss)
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.slow
def test_per_tensor_top_k_is_refused_on_local_shards():
    for why in spawn(_refused, 2, env={"LOCAL_WORLD_SIZE": "2"}):
        assert "set topk_layout='flat' and sparse_clip='none', or model_sharding='none'" in why, why


MEMORY_RUNS = [(s, sharding, place) for s in ("diloco", "sparseloco")
               for sharding, place in (("none", "device"), ("node", "device"), ("node", "cpu"))]


def _memory(rank: int, world: int) -> dict:
    from engine.runtime.memory_accounting import held_bytes, track_round_temporaries
    from tests.engine.test_memory_accounting_sharded import Blocks, _loss, _stream

    out = {}
    for strategy, sharding, place in MEMORY_RUNS:
        cfg = EngineConfig(strategy=strategy, lr=1e-3, micro_batches=1, accumulation="fixed", max_steps=2 * H,
                           inner_steps=H, model_sharding=sharding, topology="two_level", outer_state_device=place)
        engine = Engine(Blocks(), cfg, _loss)
        peaks = track_round_temporaries(engine.strategy)
        history = engine.fit(_stream(rank, 50))
        engine.close()
        held = held_bytes(engine.model, engine.ctx, engine.strategy)
        outer = [engine.strategy.theta_sync, engine.strategy.submitted,
                 *engine.strategy.outer_tensors().values()]
        out[strategy, sharding, place] = {
            "held": held, "temps": max(peaks), "loss": history[-1]["loss"], "values": engine.flat.numel,
            "outer_bytes": sum(t.untyped_storage().nbytes() for t in outer),
            "outer_on": sorted({t.device.type for t in outer})}
    return out


@pytest.mark.slow
def test_sharded_local_steps_hold_at_most_0_7_of_the_unsharded_bytes():
    """2 nodes x 2 ranks, 4 blocks of 128 x 128 (fp32): what the engine's own accounting
    (engine/runtime/memory_accounting.py) finds held after the run, plus the largest set of a
    round's temporaries, with model_sharding='node' against the two-level run without it."""
    runs = spawn(_memory, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=600)
    rows = []
    for strategy in ("diloco", "sparseloco"):
        plain = runs[0][strategy, "none", "device"]
        whole = sum(plain["held"].values()) + plain["temps"]
        for place in ("device", "cpu"):
            got = runs[0][strategy, "node", place]
            total = sum(got["held"].values()) + got["temps"]
            rows.append(f"{strategy} node-sharded, outer state on {place}: {total} B held + round temporaries "
                        f"against {whole} B unsharded ({total / whole:.3f}); "
                        + ", ".join(f"{k} {got['held'][k]}/{plain['held'][k]}" for k in got["held"])
                        + f", temporaries {got['temps']}/{plain['temps']}; outer state {got['outer_bytes']} B "
                        f"against {plain['outer_bytes']} B; final loss {got['loss']:.6f} against {plain['loss']:.6f}")
            assert total <= 0.7 * whole, rows[-1]
            assert abs(got["loss"] - plain["loss"]) <= 1e-3 * abs(plain["loss"]), rows[-1]
            # the outer state (theta_sync, the snapshot, momentum or error: 3 fp32 values each) is this rank's
            # local shards, 1/G of the model, as a node replica's slice is
            assert got["outer_bytes"] == 12 * (got["held"]["gradients"] // 4) <= plain["outer_bytes"], rows[-1]
            assert got["outer_on"] == ["cpu"]
    print("\n".join(rows))
    for other in runs[1:]:  # every rank holds the same
        for key, got in other.items():
            assert got["held"] == runs[0][key]["held"], key


SGD_STEPS = 8  # two of local_sgd's periods of 4


def _sgd_config(sharding: str, k: int) -> EngineConfig:
    return EngineConfig(strategy="local_sgd", optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=0.05,
                        micro_batches=k, accumulation="fixed", max_steps=SGD_STEPS, align=8, model_sharding=sharding)


def _local_sgd(rank: int, world: int, sharding: str, g: int) -> dict:
    """Node-sharded: each rank its own micro-batch per step. Unsharded (one worker per node): worker
    m runs node m's ranks' micro-batches of the step, in rank order."""
    from tests.engine.test_model_sharding import sharded_tiny

    if sharding == "node":
        data = worker_stream(rank, SGD_STEPS + 1)
    else:
        streams = [worker_stream(r, SGD_STEPS + 1) for r in range(rank * g, (rank + 1) * g)]
        data = [s[t] for t in range(SGD_STEPS + 1) for s in streams]
    engine = Engine(sharded_tiny(), _sgd_config(sharding, 1 if sharding == "node" else g), mse_loss)
    it, snaps, losses = iter(data), [], []
    for _ in range(SGD_STEPS):
        losses += [h["loss"] for h in engine.fit(it, steps=1)]
        snaps.append(whole_params(engine.model))
    out = {"snaps": snaps, "loss": losses, "local": engine.flat.numel, "kind": engine.topology}
    engine.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("m,g", [(2, 2), (2, 3)])
def test_sharded_local_sgd_matches_one_worker_per_node(m, g):
    """local_sgd node-sharded (a node is one replica) against the unsharded run of one worker per
    node that runs the node's micro-batches: bit for bit at 2 ranks per node (FSDP2's a + b is the
    worker's accumulation), within 1e-6 at 3."""
    sharded = spawn(_local_sgd, m * g, "node", g, env={"LOCAL_WORLD_SIZE": str(g)})
    plain = spawn(_local_sgd, m, "none", g, env={"LOCAL_WORLD_SIZE": "1"})
    bound = 0.0 if g == 2 else 1e-6
    assert sharded[0]["kind"] == "node_sharded" and plain[0]["kind"] == "flat"
    for r in range(m * g):
        want = plain[r // g]
        for t in range(SGD_STEPS):
            assert rel_err(sharded[r]["snaps"][t], want["snaps"][t]) <= bound, (r, t)
        assert rel_err(torch.tensor(sharded[r]["loss"]), torch.tensor(want["loss"])) <= max(bound, 1e-7), r
    # between averages the nodes differ; after one (every 4 steps) every rank holds the same
    assert not torch.equal(sharded[0]["snaps"][1], sharded[g]["snaps"][1])
    assert all(torch.equal(s["snaps"][3], sharded[0]["snaps"][3]) for s in sharded)
    assert sum(sharded[r]["local"] for r in range(g)) == sharded[0]["snaps"][0].numel()


ONEBIT_STEPS = 6  # 2 AdamW steps of warmup, then 4 compressed ones


def _onebit(rank: int, world: int, directory: str) -> dict:
    """1-bit Adam node-sharded and unsharded (two-level) on grouped_model (every weight's rows cut
    into whole 128-value sign groups under both layouts); and a resume across the freeze."""
    from tests.engine.test_model_sharding import grouped_model

    def cfg(sharding: str, steps: int = ONEBIT_STEPS) -> EngineConfig:
        return EngineConfig(strategy="onebit_adam", lr=1e-2, micro_batches=1, accumulation="fixed", max_steps=steps,
                            onebit_warmup_steps=2, topology="two_level", model_sharding=sharding)

    out = {}
    for sharding in ("node", "none"):
        engine = Engine(grouped_model(), cfg(sharding), mse_loss)
        it, snaps, losses = iter(worker_stream(rank, ONEBIT_STEPS + 1)), [], []
        for _ in range(ONEBIT_STEPS):
            losses += [h["loss"] for h in engine.fit(it, steps=1)]
            snaps.append(whole_params(engine.model))
        out[sharding] = {"snaps": snaps, "loss": losses, "frozen": engine.strategy.state is not None,
                         "state": engine.strategy.state.momentum.numel(), "kind": engine.topology}
        engine.close()
    data = worker_stream(rank, ONEBIT_STEPS + 1)
    first = Engine(grouped_model(), cfg("node", 3), mse_loss)
    first.fit(iter(data))
    first.save(directory)
    first.close()
    model = grouped_model(seed=7)
    resumed = Engine.load(directory, model, cfg("node"), mse_loss)
    resumed.fit(itertools.islice(iter(data), resumed.consumed, None))
    out["resumed_equal"] = torch.equal(whole_params(model), out["node"]["snaps"][-1])
    resumed.close()
    return out


@pytest.mark.slow
def test_sharded_onebit_adam_matches_the_unsharded_run_and_resumes(tmp_path):
    runs = spawn(_onebit, 4, str(tmp_path / "ckpt"), env={"LOCAL_WORLD_SIZE": "2"}, timeout=600)
    whole = runs[0]["node"]["snaps"][0].numel()
    for r, run in enumerate(runs):
        got, want = run["node"], run["none"]
        assert got["kind"] == "node_sharded" and got["frozen"] and want["frozen"]
        for t in range(ONEBIT_STEPS):
            assert torch.equal(got["snaps"][t], runs[0]["node"]["snaps"][t]), (r, t)  # every rank alike
            assert torch.equal(got["snaps"][t], want["snaps"][t]), (r, t)  # bit for bit: 2 ranks, 1 micro-batch
        assert got["loss"] == want["loss"], r
        assert got["state"] <= whole // 2 + 2 * 128  # the compressed stage's state: the local shards, 1/G
        assert run["resumed_equal"], r
