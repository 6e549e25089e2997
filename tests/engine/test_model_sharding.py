"""model_sharding='node' (engine/parallel/sharding.py): the model sharded over each node's ranks with
FSDP2, the exchange across nodes on the local shards, in real gloo groups of M nodes x G ranks.

Against the float64 reference of each strategy, and against the unsharded two-level run of the
same configuration: bit for bit where the arithmetic order is the same (one micro-batch per round
and two ranks per node: FSDP2's node sum is the unsharded run's a + b), else within float32
summation order (FSDP2 reduce-scatters each micro-batch, the unsharded run sums a rank's
micro-batches first): the largest relative difference measured after 6 steps of zero1, acco and
acco + loco4 + int4 deltas on grouped_model was 5.0e-8 at 2 x 2 with 2 micro-batches per round
and 4.7e-8 at 2 x 3 with 1, bounded here by 1e-6."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import Reference, mse_loss, rel_err, tiny_model, worker_stream

STEPS = 6
# (nodes, ranks per node, micro-batches per round): 2 x 2 at one micro-batch adds in the same
# order as the unsharded run; 2 x 3 cuts dim 0 unevenly (16 rows -> 6, 6, 4) and sums in another
LAYOUTS = [(2, 2, 1), (2, 3, 2)]
UNSHARDED_BOUND = {1: 0.0, 2: 1e-6}  # by micro-batches per round, at these layouts


def whole_params(model) -> torch.Tensor:
    """The trainable parameters, whole (FSDP2's DTensors gathered in the node: a compute-side
    collective, on every rank of the node)."""
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1)
                      for p in model.parameters() if p.requires_grad])


def sharded_tiny(seed=0):
    model = tiny_model(seed)
    model.sharding_blocks = [model[0], model[2]]  # FSDP2 unit per Linear, then the root
    return model


def grouped_model(seed=0):
    """Every trainable weight's rows split evenly over 2 or 3 ranks into multiples of the codec's
    128-value groups, so the sharded and unsharded runs quantize the same groups; the head is
    frozen (FSDP2 shards it too, the exchange leaves it out)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 384, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(384, 6, bias=False), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model[4].requires_grad_(False)
    model.sharding_blocks = [model[0], model[2], model[4]]
    return model


RUNS = {  # name: (model, its settings)
    "zero1": (sharded_tiny, dict(strategy="zero1", weight_decay=0.1)),
    "acco": (sharded_tiny, dict(strategy="acco", weight_decay=0.1, comm_chunks=2)),
    "acco+loco4+int4": (grouped_model, dict(strategy="acco", codec="loco4", param_codec="int4")),
}


def _runs(rank: int, world: int, k: int):
    return {sharding: _runs_of(rank, sharding, k) for sharding in ("node", "none")}


def _runs_of(rank: int, sharding: str, k: int):
    out = {}
    for name, (build, kw) in RUNS.items():
        model = build()
        cfg = EngineConfig(lr=1e-2, micro_batches=k, accumulation="fixed", max_steps=STEPS, align=8,
                           topology="two_level", model_sharding=sharding, **kw)
        engine = Engine(model, cfg, mse_loss)
        it = iter(worker_stream(rank, 3 * k * (STEPS + 1)))
        snaps = []
        for _ in range(STEPS):
            engine.fit(it, steps=1)
            snaps.append(whole_params(model))
        out[name] = {"snaps": snaps, "local": engine.flat.numel, "master": engine.shard_state.master.numel(),
                     "frozen": [type(p).__name__ for p in model.parameters() if not p.requires_grad],
                     "loss": [h["loss"] for h in engine.history],
                     "inter": [h["wire_bytes_inter"] for h in engine.history]}
        engine.close()
    return out


@pytest.mark.parametrize("m,g,k", [LAYOUTS[0], pytest.param(*LAYOUTS[1], marks=pytest.mark.slow)])
def test_node_sharding_matches_the_reference_and_the_unsharded_two_level_run(m, g, k):
    world = m * g
    runs = spawn(_runs, world, k, env={"LOCAL_WORLD_SIZE": str(g)})
    sharded, unsharded = [r["node"] for r in runs], [r["none"] for r in runs]
    streams = [worker_stream(r, 3 * k * (STEPS + 1)) for r in range(world)]
    for name in RUNS:
        got = [sharded[r][name] for r in range(world)]
        for step in range(STEPS):
            for r in range(world):  # every rank of every node holds the same parameters
                assert torch.equal(got[r]["snaps"][step], got[0]["snaps"][step]), (name, step, r)
            diff = rel_err(got[0]["snaps"][step], unsharded[0][name]["snaps"][step])
            assert diff <= UNSHARDED_BOUND[k], (name, step, diff)
        if name in ("zero1", "acco"):
            want = Reference(tiny_model(0), streams, k, lr=1e-2, weight_decay=0.1).run(name, STEPS)
            for step in range(STEPS):
                assert rel_err(got[0]["snaps"][step], want[step]) < 1e-6, (name, step)
        # each rank exchanges its 1/G of the trainable values; its optimizer owns 1/(G x M)
        whole = got[0]["snaps"][0].numel()
        assert sum(got[r]["local"] for r in range(g)) == whole
        assert all(got[r]["master"] * m * g <= whole + m * g * 128 for r in range(world))
        assert unsharded[0][name]["master"] * world >= whole
    frozen = sharded[0]["acco+loco4+int4"]["frozen"]
    assert frozen == ["DTensor", "DTensor"]  # the frozen head is sharded too
    losses = sharded[0]["acco+loco4+int4"]["loss"]
    assert losses[-1] < losses[0]
    # the same bytes cross the node links as in the unsharded two-level run (where no padding
    # differs: the tiny model's uneven local shards pad less than the whole buffer does)
    for r in range(world):
        assert sharded[r]["acco+loco4+int4"]["inter"] == unsharded[r]["acco+loco4+int4"]["inter"], r


def test_model_sharding_refusals_name_what_to_use():
    # every registered strategy runs node-sharded (the local-step ones and onebit_adam:
    # tests/engine/test_local_steps_sharded.py); what is refused is the layout
    with pytest.raises(ValueError, match="needs topology='auto' or 'two_level'"):
        EngineConfig(model_sharding="node", topology="flat")
    with pytest.raises(ValueError, match="model_sharding"):
        EngineConfig(model_sharding="rows")


def _checkpointing(rank: int, world: int):
    out = {}
    for sharding, recompute in (("node", False), ("node", True), ("none", True)):
        model = sharded_tiny()
        cfg = EngineConfig(strategy="acco", lr=1e-2, micro_batches=2, accumulation="fixed", max_steps=3, align=8,
                           model_sharding=sharding, activation_checkpointing=recompute)
        engine = Engine(model, cfg, mse_loss)
        engine.fit(iter(worker_stream(rank, 20)))
        out[sharding, recompute] = (whole_params(model), all(getattr(b, "_acco_checkpointed", False)
                                                             for b in model.sharding_blocks))
        engine.close()
    return out


def test_activation_checkpointing_recomputes_the_same_gradients():
    """One node of 2 ranks (the rail is one rank): each block's forward is checkpointed and the
    trajectory is bit for bit the one that keeps its activations, sharded or not."""
    runs = spawn(_checkpointing, 2, env={"LOCAL_WORLD_SIZE": "2"})
    for run in runs:
        plain, checkpointed, unsharded = run["node", False], run["node", True], run["none", True]
        assert checkpointed[1] and unsharded[1] and not plain[1]
        assert torch.equal(checkpointed[0], plain[0])
        assert rel_err(unsharded[0], plain[0]) < 1e-6
        assert torch.equal(run["node", True][0], runs[0]["node", True][0])
