"""diloco and sparseloco with the outer state on the CPU make only piece-sized temporaries in their outer
round (sparseloco: and its top-k payloads, about 1% of the values), and a node replica's offloaded inner
step keeps its gradient's host copy in two piece slots (issue 41: 70B within a node's host memory). The pieces are made small here (1024 values; the engine's are 2^22 for
the outer round, 2^20 for the inner step) so that a round runs in many of them on a small model; the
values must stay those of the run with the outer state on the device, bit for bit.

Real gloo groups, 2 nodes x 2 ranks, model_sharding='node', fp32, the torch path (what a GPU runs).
What is held against what (engine/planner/memory.py ``local_node_sharded``):
- a round's largest set of temporaries (engine/runtime/memory_accounting.py track_round_temporaries)
  against OUTER_HOST_PIECES: 12 bytes per value of a piece, + 4 per local value with outer_overlap
  (the pseudo-gradient's own buffer), and up to 8 per value of a piece that gloo releases late here;
- the offload's host bytes (host_held_bytes) against the inner AdamW state 12 V, two gradient slots
  and the step's scratch, each a piece long."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.local_group import spawn
from engine.planner import memory
from tests.engine.test_model_sharding import whole_params

PIECE = 1024  # values per outer piece, per exchange (every rank's columns together) and per inner piece
H, ROUNDS = 2, 3


def _set_pieces(outer: int, inner: int) -> None:
    """The piece sizes the engine reads at run time (inner_step's PIECE is read by the step and by
    local_steps' gradient pieces: the two must agree)."""
    from engine.strategies import inner_step, local_steps
    from engine.strategies.diloco import DiLoCo
    from engine.strategies.sparseloco import SparseLoCo

    DiLoCo.outer_piece = DiLoCo.wire_piece = SparseLoCo.outer_piece = outer
    inner_step.PIECE = local_steps.PIECE = inner


# the strategies' own settings: sparseloco's chunks small, so that a 1024-value piece holds 16 of them
STRATEGY = {"diloco": {"strategy": "diloco", "outer_lr": 0.7, "outer_momentum": 0.9},
            "sparseloco": {"strategy": "sparseloco", "outer_lr": 1.0, "topk_chunk": 64, "topk_density": 0.1}}


def _train(rank: int, strategy: str = "diloco", **kw) -> dict:
    from engine import Engine, EngineConfig
    from engine.runtime.memory_accounting import (
        host_held_bytes,
        track_round_temporaries,
    )
    from tests.engine.test_memory_accounting_sharded import Blocks, _loss, _stream

    cfg = EngineConfig(lr=1e-2, weight_decay=0.1, micro_batches=1, accumulation="fixed",
                       max_steps=ROUNDS * H, inner_steps=H, topology="two_level", model_sharding="node",
                       **STRATEGY[strategy], **kw)
    engine = Engine(Blocks(), cfg, _loss)
    peaks = track_round_temporaries(engine.strategy)
    it, snaps, losses = iter(_stream(rank, ROUNDS * H + 1)), [], []
    for _ in range(ROUNDS * H):
        losses += [h["loss"] for h in engine.fit(it, steps=1)]
        snaps.append(whole_params(engine.model))
    st = engine.strategy
    out = {"snaps": snaps, "loss": losses, "sync": st.theta_sync.detach().cpu().clone(), "peaks": peaks,
           "host": host_held_bytes(st), "values": st.theta_sync.numel(),
           "slots": [t.numel() for t in st.offload.grad_slots] if st.offload is not None else None,
           "whole_grad": st.offload is not None and st.offload.grad is not None}
    engine.close()
    return out


def _runs(rank: int, world: int) -> dict:
    from acco_loco import kernels

    kernels.use(False)  # the torch path: what runs on a GPU (and its temporaries are what the mode sees)
    out = {}
    for overlap in (False, True):  # the references first, at the engine's own pieces
        out["device", overlap] = _train(rank, outer_overlap=overlap)
    _set_pieces(PIECE, PIECE)
    for overlap in (False, True):
        out["cpu", overlap] = _train(rank, outer_overlap=overlap, outer_state_device="cpu", optimizer_offload="cpu")
    return out


def _same_as_on_device(run: dict, rank: int, overlap: bool) -> dict:
    """The run with the outer state on the CPU against the one on the device: parameters after every
    step, losses and theta_sync bit for bit; over many pieces (or the test shows nothing)."""
    got, want = run["cpu", overlap], run["device", overlap]
    for t, (a, b) in enumerate(zip(got["snaps"], want["snaps"])):
        assert torch.equal(a, b), (rank, overlap, t)
    assert got["loss"] == want["loss"] and torch.equal(got["sync"], want["sync"]), (rank, overlap)
    assert got["values"] > 16 * PIECE
    return got


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_outer_round_on_host_state_makes_piece_sized_temporaries():
    runs = spawn(_runs, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=500)
    piece_bytes, overlap_bytes = memory.OUTER_HOST_PIECES["outer_sgd_s_per_param"]
    for r, run in enumerate(runs):
        for overlap in (False, True):
            got, want = _same_as_on_device(run, r, overlap), run["device", overlap]
            v = got["values"]
            # every round's temporaries: a piece's (12 bytes a value: the step's proposal and its
            # intermediate), and with overlap the pseudo-gradient's own buffer; the small all-reduce besides.
            # On this CPU-only machine the exchange's wire rows are host tensors too, and gloo's thread may
            # release an earlier piece's sent and received rows (8 bytes a value) after the next piece's are
            # made: allowed here; on a GPU those rows are device pieces, not host bytes
            bound = piece_bytes * PIECE + 8 * PIECE + (overlap_bytes * v if overlap else 0) + 1024
            row = (f"rank {r} overlap {overlap}: round temporaries {max(got['peaks'])} bytes (bound {bound}; "
                   f"on the device {max(want['peaks'])}), {v} local values")
            print(row)
            assert len(got["peaks"]) == ROUNDS and max(got["peaks"]) <= bound, row
            assert max(got["peaks"]) >= piece_bytes * PIECE - 1024, row  # the formula's piece is what is made
            # the inner state, the gradient in two piece slots (no whole copy), the step's piece scratch
            assert got["slots"] == [PIECE, PIECE] and not got["whole_grad"], got["slots"]
            assert got["host"] == 12 * v + 2 * 4 * PIECE + 4 * PIECE, (r, got["host"], v)


def test_the_planner_keeps_diloco_host_round_piece_sized():
    """At 70B on 8 x 8 (V = P/G) the diloco row with the outer and inner state on the CPU holds 24 bytes
    a local value in host memory and a few pieces (12 of the outer state, 12 of the inner), not 48;
    sparseloco's the same and its payloads (it held 24 + 36.25 before its round ran in pieces)."""
    from engine.parallel.topology import Layout
    from engine.planner.modes import Mode
    from engine.planner.shape import PRESETS
    from engine.planner.wire import WireSettings

    shape, layout, ws = PRESETS["70b"], Layout(8, 8), WireSettings(compute_bytes=2)
    v = shape.trainable / 8
    row = Mode("diloco", exchange="two-level", sharding="node", outer_state="cpu", offload="cpu")
    got = memory.memory_per_gpu(row, shape, layout, ws)
    pieces = 12 * memory.OUTER_PIECE + 2 * 4 * memory.INNER_PIECE + 4 * memory.INNER_PIECE
    assert got.host == pytest.approx(24 * v + pieces)
    overlapped = memory.memory_per_gpu(Mode("diloco", exchange="two-level", sharding="node", outer_state="cpu",
                                            offload="cpu", outer_overlap=True), shape, layout, ws)
    assert overlapped.host == pytest.approx(28 * v + pieces)
    from acco_loco.topk_codec import TopKCodec

    payload = TopKCodec(ws.topk_chunk, ws.topk_density, ws.topk_bits).payload_bytes(int(v))  # about 1% of 4 V
    assert payload < 0.05 * v
    slots = 2 * 4 * memory.INNER_PIECE + 4 * memory.INNER_PIECE
    for overlap in (False, True):  # sparseloco: its round in pieces, its own payload and the 8 nodes' gathered
        sparse = memory.memory_per_gpu(Mode("sparseloco", exchange="two-level", sharding="node", outer_state="cpu",
                                            offload="cpu", outer_overlap=overlap), shape, layout, ws)
        assert sparse.host == pytest.approx(24 * v + 29 * memory.OUTER_PIECE + 9 * payload + slots)


def test_gradient_pieces_take_two_slots_in_turn_and_give_every_piece():
    """HostOptimizer.gradient_pieces (engine/runtime/offload.py): each piece's values, from two host slots
    reused in turn (piece k in slot k % 2), counted once; a bf16 gradient arrives as fp32; no whole copy."""
    from acco_loco.shard_state import ShardState
    from engine.runtime.offload import GRAD_SLOTS, HostOptimizer, pieces_of

    n, piece = 10, 3
    state = ShardState(master=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n), step=0)
    offload = HostOptimizer(state, torch.device("cpu"), whole_gradient=False)
    grad = torch.arange(n, dtype=torch.bfloat16)
    pieces = pieces_of(n, piece)
    ready = offload.gradient_pieces(grad, pieces)
    storages = []
    for k, (a, b) in enumerate(pieces):
        got = ready(k)
        assert got.dtype == torch.float32 and torch.equal(got, grad[a:b].float()), (k, got)
        storages.append(got.untyped_storage().data_ptr())
    assert GRAD_SLOTS == 2 and storages == [storages[0], storages[1]] * 2 and storages[0] != storages[1]
    assert offload.grad is None and offload.bytes_to_host == 4 * n
    assert sum(t.numel() for t in offload.host_tensors()) == 3 * n + 2 * piece
    with pytest.raises(RuntimeError, match="gradient_pieces"):
        offload.fetch_gradient(grad, pieces)
    with pytest.raises(ValueError, match="host state of 10"):
        offload.gradient_pieces(torch.zeros(n + 1), pieces)


def _sparse_runs(rank: int, world: int) -> dict:
    from acco_loco import kernels

    kernels.use(False)  # the torch path: what runs on a GPU
    out = {}
    for overlap in (False, True):  # the references first, at the engine's own pieces
        out["device", overlap] = _train(rank, "sparseloco", outer_overlap=overlap)
    _set_pieces(PIECE, PIECE)
    for overlap in (False, True):
        out["cpu", overlap] = _train(rank, "sparseloco", outer_overlap=overlap, outer_state_device="cpu",
                                     optimizer_offload="cpu")
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sparseloco_round_on_host_state_makes_piece_sized_temporaries():
    """sparseloco's round with the outer state on the CPU, in pieces of 16 chunks (acco_loco/topk_pieces.py):
    the same values as on the device, bit for bit, with and without overlap; its largest temporaries are
    a piece's (OUTER_HOST_PIECES: per value of a piece) and the payloads' (per local value), where the
    device's round makes full-size ones (OUTER_TEMP)."""
    runs = spawn(_sparse_runs, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=500)
    from acco_loco.topk_codec import TopKCodec

    piece_bytes, overlap_bytes = memory.OUTER_HOST_PIECES["outer_topk_s_per_param"]
    settings = STRATEGY["sparseloco"]
    codec = TopKCodec(settings["topk_chunk"], settings["topk_density"])
    for r, run in enumerate(runs):
        for overlap in (False, True):
            got, want = _same_as_on_device(run, r, overlap), run["device", overlap]
            v = got["values"]
            # a piece's (its top-k keys, or its combined step), no overlap buffer (overlap_bytes 0), and the
            # payloads: its own and the 2 nodes' gathered (topk_payload_host_bytes); the small all-reduce besides
            payloads = (2 + 1) * codec.payload_bytes(v)
            bound = piece_bytes * PIECE + overlap_bytes * v + payloads + 1024
            row = (f"rank {r} overlap {overlap}: round temporaries {max(got['peaks'])} bytes (bound {bound}; "
                   f"on the device {max(want['peaks'])}), {v} local values")
            print(row)
            assert len(got["peaks"]) == ROUNDS and max(got["peaks"]) <= bound, row
            # the formula's piece is what is made (less the 4 B a value of a padded last chunk: none here)
            assert max(got["peaks"]) >= (piece_bytes - 4) * PIECE, row
            assert max(want["peaks"]) >= 25 * v, row  # the whole round's, for contrast


SPARSE_OPTIONS = {"plain": {}, "templar's": {"sparse_clip": "median", "sparse_aggregate": "contributors",
                                              "sparse_error_scale": "outer_lr"}}


@pytest.mark.parametrize("options", SPARSE_OPTIONS)
def test_sparseloco_pieces_on_one_worker_keep_values_and_verdicts(monkeypatch, options):
    """One worker, the tiny model (163 values) in pieces of 8 chunks of 8 values: with the outer state on
    the CPU the parameters, theta_sync, the error and the history equal the device placement's bit for bit,
    with each option the flat layout takes (the median clip's norms in a first pass); a new theta_sync whose
    last value is made non-finite skips the round with nothing installed, not even the earlier pieces, as on
    the device; and the piecewise check of the pseudo-gradient flags a NaN or an Inf in any piece."""
    from engine import Engine
    from engine.strategies.sparseloco import SparseLoCo
    from tests.engine.test_local_steps import H, config, tiny_model
    from tests.tiny import flat_params, mse_loss, worker_stream

    monkeypatch.setattr(SparseLoCo, "outer_piece", 64)
    kw = {"topk_chunk": 8, "topk_density": 0.25, **SPARSE_OPTIONS[options]}
    from engine.strategies import sparseloco

    step = sparseloco.sparse_outer_step

    def last_value_inf(theta_sync, delta, lr):  # the new theta_sync's last value (in the last piece) non-finite
        out = step(theta_sync, delta, lr)
        if theta_sync.storage_offset() + theta_sync.numel() == theta_sync.untyped_storage().nbytes() // 4:
            out[-1] = float("inf")
        return out

    for poisoned in (False, True):
        monkeypatch.setattr(sparseloco, "sparse_outer_step", last_value_inf if poisoned else step)
        runs = {}
        for place in ("device", "cpu"):
            engine = Engine(tiny_model(0), config("sparseloco", 2, outer_state_device=place, **kw), mse_loss)
            hist = engine.fit(iter(worker_stream(0, 40)), steps=2 * H)
            st = engine.strategy
            runs[place] = {"params": flat_params(engine.model), "sync": st.theta_sync.clone(),
                           "error": st.error.clone(), "hist": [(h["loss"], h["skipped"]) for h in hist],
                           "pieces": st.pieces}
            engine.close()
        cpu, dev = runs["cpu"], runs["device"]
        assert dev["pieces"] is None and len(cpu["pieces"]) == 3, cpu["pieces"]  # 64 + 64 + 35 values
        assert cpu["hist"] == dev["hist"], options
        assert all(torch.equal(cpu[k], dev[k]) for k in ("params", "sync", "error")), (options, poisoned)
        start = flat_params(tiny_model(0))
        assert torch.equal(cpu["sync"][:start.numel()], start) == poisoned  # nothing installed, no piece
    # the round's input check, a piece at a time (st: the last cpu run's)
    assert st.form_pseudo_gradient() is None and st.pseudo_gradient_flag(None).item() == 0.0
    for bad in (float("nan"), float("inf")):
        for at in (3, 70, 150):  # each piece
            st.submitted[at] = bad
            assert st.pseudo_gradient_flag(None).item() == 1.0, (bad, at)
            st.submitted[at] = 0.0
