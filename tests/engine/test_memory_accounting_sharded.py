"""What a rank holds after a step of a model_sharding='node' run (engine/parallel/sharding.py: FSDP2 over
the node's G ranks, the exchange across nodes on the local shards) against the formula of
engine/planner/sharded_bytes.py (``node_sharded_bytes``), in real gloo groups at 2 nodes x 2 ranks and 1
node x 4 ranks, for zero1, acco and acco+loco4+int4params on a model of several blocks; and the
sharded run's parameters and gradients against the unsharded run's (two-level; on one node, flat): 1/G
of them."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.local_group import spawn
from engine.planner import sharded_bytes
from engine.runtime.memory_accounting import CATEGORIES

MODES = {
    "zero1": dict(strategy="zero1"),
    "acco": dict(strategy="acco"),
    "acco+loco4+int4params": dict(strategy="acco", codec="loco4", param_codec="int4"),
}
DTYPES = {"float32": 4, "bfloat16": 2}
BLOCKS, WIDTH = 4, 128  # rows of every weight divide by 2 and 4: FSDP2 pads no local shard


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 8, bias=False)
        self.head.requires_grad_(False)  # frozen: FSDP2 shards it, the exchange leaves it out

    def forward(self, x):
        x = x.to(self.head.weight.dtype)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _stream(rank: int, n: int):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, WIDTH, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def _measure(rank: int, world: int, dtypes: tuple[str, ...]) -> dict:
    from acco_loco import kernels
    from engine import Engine, EngineConfig
    from engine.runtime.memory_accounting import fsdp_unsharded_bytes, held_bytes, track_round_temporaries

    kernels.use(False)  # the torch path: what runs on a GPU
    out = {}
    for dtype in dtypes:
        for name, kw in MODES.items():
            for sharding in ("node", "none"):
                cfg = EngineConfig(lr=1e-3, micro_batches=1, accumulation="fixed", max_steps=3, compute_dtype=dtype,
                                   model_sharding=sharding, **kw)  # (unsharded: two-level, flat on one node)
                engine = Engine(Blocks(), cfg, _loss)
                peaks = track_round_temporaries(engine.strategy)
                engine.fit(_stream(rank, 50))
                engine.close()
                out[(dtype, name, sharding)] = dict(
                    held=held_bytes(engine.model, engine.ctx, engine.strategy), temps=max(peaks[2:]), padded=engine.flat.padded,
                    chunks=engine.comm.chunks, fsdp=fsdp_unsharded_bytes(engine.model))
    return out


def _check(results, nodes: int, per_node: int, dtypes: tuple[str, ...]):
    rows = []
    frozen = WIDTH * 8
    for dtype in dtypes:
        e = DTYPES[dtype]
        for name, kw in MODES.items():
            got = results[0][(dtype, name, "node")]
            held, padded = got["held"], got["padded"]
            want = sharded_bytes.node_sharded_bytes(
                padded, nodes=nodes, overlap=kw["strategy"] == "acco", kept_shards=int(kw["strategy"] == "acco"),
                codec=kw.get("codec", "none"), param_codec=kw.get("param_codec", "auto"), compute_bytes=e,
                chunks=got["chunks"], backend="gloo", frozen=frozen / per_node)
            got_total, want_total = sum(held.values()) + got["temps"], sum(want.values())
            rows.append(f"{dtype} {name} at {nodes}x{per_node}: held {got_total / padded:.2f} B per local value, "
                        f"formula {want_total / padded:.2f}; "
                        + ", ".join(f"{k} {held[k] / padded:.2f}/{want[k] / padded:.2f}" for k in CATEGORIES)
                        + f", temporaries {got['temps'] / padded:.2f}/{want['temporaries'] / padded:.2f}")
            assert got["fsdp"] == 0, rows[-1]  # FSDP2 resharded every block: no unsharded storage is held
            for k in CATEGORIES:  # every buffer the formula names is what is held, no copy besides
                assert held[k] == pytest.approx(want[k], rel=0.02, abs=1024), (k, rows[-1])
            assert got_total == pytest.approx(want_total, rel=0.10), rows[-1]
            # the sharded run's parameters and gradients are 1/G of the unsharded two-level run's
            whole = results[0][(dtype, name, "none")]["held"]
            state = ("parameters", "gathered", "gradients")
            ratio = sum(held[k] for k in state) / sum(whole[k] for k in state)
            rows[-1] += f"; parameters + gradients {ratio:.3f} of the unsharded run's"
            assert ratio <= 1 / per_node + 0.10, rows[-1]
    print("\n".join(rows))
    for other in results[1:]:  # the layout is symmetric: every rank holds the same
        for key, got in other.items():
            assert got["held"] == results[0][key]["held"], key


def test_node_sharded_layout_holds_what_the_formula_says_2x2():
    results = spawn(_measure, 4, ("bfloat16",), timeout=600, env={"LOCAL_WORLD_SIZE": "2"})
    _check(results, 2, 2, ("bfloat16",))


def test_node_sharded_layout_holds_what_the_formula_says_1x4():
    results = spawn(_measure, 4, ("float32",), timeout=600, env={"LOCAL_WORLD_SIZE": "4"})
    _check(results, 1, 4, ("float32",))


@pytest.mark.parametrize("argv", [
    ["--model", "70b", "--nodes", "8", "--gpus-per-node", "8", "--inter-gbit", "10"],
    ["--model", "8b", "--nodes", "2", "--gpus-per-node", "8", "--inter-gbit", "1"],
])
def test_the_planner_recommends_a_mode_that_fits_with_this_formula(argv, tmp_path, capsys):
    """issue 31's commands: with the node-sharded formula above (the runtime it was held
    against), the recommended mode's state and activations fit the preset GPU's memory."""
    import json

    from engine.plan import main

    out = tmp_path / "plan.json"
    assert main(argv + ["--global-batch", "1024", "--micro-batch", "1", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    row = next(r for r in plan["rows"] if r["mode"] == plan["recommended"])
    assert row["fits"] and "node-sharded" in row["mode"], row["mode"]
    assert row["memory_bytes"] + row["activation_bytes"] <= 79.6 * 2**30
    sharded = sharded_bytes.node_sharded_bytes(1e9, nodes=8, overlap=False, compute_bytes=2)
    assert sharded["gradients"] == 2e9 and sharded["gathered"] == 0  # one local buffer, both uses
