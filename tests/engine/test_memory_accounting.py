"""What a rank holds after a step (engine/runtime/memory_accounting.py: the unique tensor storages of the
model and the engine, by category, and the largest set of temporaries a round makes) against the
per-parameter formula of engine/planner/memory.py (docs/design/zero1.md), in real gloo
groups: flat at N = 2 and 4, two-level at 2 nodes x 2 and x 4 ranks, for zero1, acco and
acco+loco4+int4params, fp32 and bf16 compute (grad_dtype auto: bf16 gradient buffers where the
gradient travels uncompressed, fp32 under a codec), zero1 with fp32 gradient buffers (grad_dtype
float32), and acco+loco4+int4params with the step proposed into piece-sized scratch (step_copy
'piece', what auto takes on a GPU), acco+loco4 with no rollback copy of the error
(error_after_skip 'reset', auto on a GPU), acco+loco4 with Muon, on the torch path (the one a GPU runs)."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.comm import MAX_PIECE_VALUES, PIECE_ALIGN, chunk_bounds
from engine.parallel.local_group import spawn
from engine.planner import sharded_bytes
from engine.runtime.memory_accounting import CATEGORIES, RoundTemporaries

MODES = {
    "zero1": dict(strategy="zero1"),
    "acco": dict(strategy="acco"),
    "acco+loco4+int4params": dict(strategy="acco", codec="loco4", param_codec="int4"),
    "zero1+fp32-grads": dict(strategy="zero1", grad_dtype="float32"),  # auto: the compute dtype uncompressed
    # 5 pieces: the compressed rows of piece 0 and of two slots the later pieces take in turn
    "acco+loco4 in 5 pieces": dict(strategy="acco", codec="loco4", comm_chunks=5),
    # the step proposed into piece-sized scratch (three master slots, one of moments), not a spare
    "acco+loco4+int4params, step_copy=piece in 5 pieces": dict(strategy="acco", codec="loco4", param_codec="int4",
                                                             step_copy="piece", comm_chunks=5),
    # no rollback copy of the error (what auto takes on a GPU)
    "acco+loco4, error_after_skip=reset": dict(strategy="acco", codec="loco4", error_after_skip="reset"),
    # Muon: AdamW's two moments kept at every value (the second unused at a matrix's) and the whole spare
    "acco+loco4, optimizer=muon": dict(strategy="acco", codec="loco4", optimizer="muon"),
}
DTYPES = {"float32": 4, "bfloat16": 2}
EXACT = ("parameters", "gradients", "gathered", "optimizer", "error_feedback", "strategy")


def _model():
    torch.manual_seed(0)  # 66,592 parameters: padding (N x 128 values at most) stays below 1%
    return torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 32))


def _loss(model, batch):
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(batch[0].to(dtype)).float(), batch[1])


def _stream(rank: int, n: int):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)) for _ in range(n)]


def _measure(rank: int, world: int, topology: str) -> dict:
    from acco_loco import kernels
    from engine import Engine, EngineConfig
    from engine.runtime.memory_accounting import held_bytes, track_round_temporaries

    kernels.use(False)  # the torch path: what runs on a GPU
    out = {}
    for dtype in DTYPES:
        for name, kw in MODES.items():
            cfg = EngineConfig(lr=1e-3, micro_batches=1, accumulation="fixed", max_steps=3, compute_dtype=dtype,
                               topology=topology, **kw)
            engine = Engine(_model(), cfg, _loss)
            peaks = track_round_temporaries(engine.strategy)
            engine.fit(_stream(rank, 50))
            engine.close()
            # the first step's rounds also make the kept buffers (spare, slots): the later ones
            out[(dtype, name)] = (held_bytes(engine.model, engine.ctx, engine.strategy), max(peaks[2:]), engine.flat.padded,
                                  engine.comm.chunks, engine.topology)
    return out


def _check(results, world: int, per_node: int, two_level: bool):
    rows = []
    for (dtype, name), (held, temps, padded, chunks, topology) in results[0].items():
        assert topology == ("two_level" if two_level else "flat")
        kw = MODES[name]
        want = sharded_bytes.held_bytes(padded, world=world, per_node=per_node, two_level=two_level,
                                        kept_shards=int(kw["strategy"] == "acco"), codec=kw.get("codec", "none"),
                                        param_codec=kw.get("param_codec", "auto"), compute_bytes=DTYPES[dtype],
                                        chunks=chunks, backend="gloo", step_copy=kw.get("step_copy", "whole"),
                                        error_copy=kw.get("error_after_skip", "rollback") == "rollback",
                                        grad_bytes=4 if kw.get("grad_dtype") == "float32" or "codec" in kw
                                        else DTYPES[dtype])
        got_total, want_total = sum(held.values()) + temps, sum(want.values())
        rows.append(f"{dtype} {name}: held {got_total / padded:.2f} B/param, formula {want_total / padded:.2f}; "
                    + ", ".join(f"{k} {held[k] / padded:.2f}/{want[k] / padded:.2f}" for k in CATEGORIES)
                    + f", temporaries {temps / padded:.2f}/{want['temporaries'] / padded:.2f}")
        for k in EXACT:  # the buffers the formula names one by one are exactly what is held
            assert held[k] == pytest.approx(want[k], rel=0.01, abs=64), (dtype, name, k, rows[-1])
        assert held["comm"] == pytest.approx(want["comm"], rel=0.02, abs=1024), (dtype, name, rows[-1])
        assert got_total == pytest.approx(want_total, rel=0.10), (dtype, name, rows[-1])
    print("\n".join(rows))
    # every rank holds the same (the layout is symmetric)
    for other in results[1:]:
        for key, (held, *_rest) in other.items():
            assert held == results[0][key][0], key


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_flat_layout_holds_what_the_formula_says(world):
    _check(spawn(_measure, world, "flat", timeout=600), world, 1, False)


@pytest.mark.parametrize("per_node", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_two_level_layout_holds_what_the_formula_says(per_node):
    results = spawn(_measure, 2 * per_node, "two_level", timeout=600, env={"LOCAL_WORLD_SIZE": str(per_node)})
    _check(results, 2 * per_node, per_node, True)


def test_round_temporaries_count_live_storages_until_freed():
    """The tracker: a storage counts from the op that makes it until its last view goes; views,
    in-place results and outputs into existing tensors add nothing."""
    kept = torch.zeros(1000)
    with RoundTemporaries() as mode:
        a = torch.empty(1000)  # 4000 bytes
        view = a[10:20]
        b = a * 2  # another 4000
        kept.add_(1.0)  # in place on a storage made elsewhere
        torch.mul(kept, 3.0, out=kept)
        del a
        assert mode.live == 8000  # the view keeps a's storage
        del view
        assert mode.live == 4000
        del b
        c = torch.ones(250)
        assert mode.live == 1000
    assert mode.peak == 8000 and c.numel() == 250


def test_the_planner_pieces_are_the_engines():
    assert sharded_bytes.MAX_PIECE_VALUES == MAX_PIECE_VALUES and sharded_bytes.PIECE_ALIGN == PIECE_ALIGN
    for size, count, unit in [(8352, 5, 128), (100, 3, 32), (40, 1, 32), (1000, 8, 32), (96, 5, 32)]:
        bounds = chunk_bounds(size, count, unit)
        assert sharded_bytes._longest_piece(size, count, unit) == (len(bounds), max(b - a for a, b in bounds))


@pytest.mark.parametrize("stochastic", [False, True])
def test_the_pieced_torch_encode_gives_the_whole_buffers_bits_without_its_temporaries(stochastic):
    """The torch path of the compressed reduce-scatter (what a GPU runs) against one whole-buffer
    compress with the same error state and generator: the same sums and the same error state,
    round after round, while no temporary as large as an fp32 copy of the gradient is made."""
    from acco_loco.feedback import ErrorFeedback, compress
    from acco_loco.registry import GradCodecSpec, make_codec
    from engine.parallel.collectives import CompressedGrads
    from engine.parallel.comm import Comm

    numel, group, count = 8 * 4096, 128, 3
    kernels_were = __import__("acco_loco.kernels", fromlist=["use"])
    kernels_were.use(False)
    try:
        grads = CompressedGrads(GradCodecSpec("loco", "int4"), numel, 1, group, "float32", 0.8, 1024, "int8",
                                torch.device("cpu"), stochastic=stochastic, seed=5)
        codec = make_codec("int4", group_size=group)
        ref = ErrorFeedback("loco", numel, beta=0.8, group_size=group)
        gen = torch.Generator().manual_seed(5) if stochastic else None
        comm = Comm(0, 1, chunks=8)
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            full = torch.randn(numel, generator=g)
            with RoundTemporaries() as mode:
                got = grads.reduce(comm, full, count).sum
            got = got.clone()
            payload, scales, _ = compress(full / count, codec, ref, gen, check_finite=False)
            want = count * codec.decode(payload, scales)
            assert torch.equal(got, want)
            assert torch.equal(grads.feedback._codes, ref._codes) and torch.equal(grads.feedback._scales, ref._scales)
            if step:  # (the first round also makes the kept output and wire buffers)
                assert mode.peak < 4 * numel, mode.peak  # the old whole-buffer encode made five of them
    finally:
        kernels_were.use(True)


def _native_in_pieces(rank: int, world: int):
    import torch.distributed as dist

    from engine.parallel.comm import Comm

    dist.init_process_group("gloo")
    comm = Comm(rank, world, chunks=3)
    g = torch.Generator().manual_seed(rank)
    full = (torch.randn(world * 960, generator=g) * (rank + 1)).to(torch.bfloat16)
    by_rows = comm.reduce_scatter_sum(full).clone()
    comm.native_reduce_scatter = True
    native = comm.reduce_scatter_sum(full).clone()
    return by_rows, native, comm._buffers[("rs.fp32",)].numel(), {k: v.numel() for k, v in comm._buffers.items()}


def test_the_native_reduce_scatter_widens_one_piece_at_a_time():
    """NCCL's path (forced on gloo): a bf16 gradient is reduced in fp32 a piece at a time through
    one fp32 buffer a piece long, with the all-to-all path's sums; the gloo path keeps two
    piece slots to send and two to receive, whatever the number of pieces."""
    world = 3
    for by_rows, native, fp32_values, kept in spawn(_native_in_pieces, world):
        torch.testing.assert_close(native, by_rows, rtol=1e-6, atol=1e-6)
        assert fp32_values == world * 320  # a third of the shard from every rank: 1/3 of the gradient
        assert sorted(k for k in kept if k[0] in ("rs.recv", "rs.send")) == [
            ("rs.recv", 0), ("rs.recv", 1), ("rs.send", 0), ("rs.send", 1)]
