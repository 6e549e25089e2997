"""Pipelined rounds (comm_chunks pieces) and the fused CPU kernels (acco_loco/kernels.py): whole
trajectories in a gloo group of 2, bit for bit the same with 1, 3 or 5 pieces, with the kernels or
the torch path, with the step proposed into the whole spare or into piece-sized scratch and
recomputed in place at install (step_copy; parameters, master, moments and error state), and the
same bytes on the wire."""

from __future__ import annotations

import torch

from acco_loco import kernels
from engine import Engine, EngineConfig
from engine.parallel.comm import chunk_bounds
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, worker_stream

MODES = {
    "acco+loco4+int4": dict(strategy="acco", codec="loco4", param_codec="int4"),
    "acco+loco2+int8": dict(strategy="acco", codec="loco2", param_codec="int8"),
    "acco": dict(strategy="acco", param_codec="float32"),
    "zero1+sgd+ef8": dict(strategy="zero1", codec="ef8", optimizer="sgd"),
    "dpu+int4+bf16": dict(strategy="dpu", codec="int4", param_codec="bfloat16"),
    "acco+loco1": dict(strategy="acco", codec="loco1", param_codec="int4"),
    # the delay corrections read and change the proposal piece by piece (Acco.after_piece)
    "acco+dc+wp": dict(strategy="acco", param_codec="float32", delay_compensation=0.5, weight_prediction=1.0),
}
STEP_COPIES = ("whole", "piece")


def test_chunk_bounds_cover_the_shard_at_aligned_starts():
    for size, chunks, unit in [(100, 3, 32), (72, 8, 32), (8, 4, 8), (4096, 8, 128), (0, 3, 8), (40, 1, 8)]:
        bounds = chunk_bounds(size, chunks, unit)
        assert len(bounds) <= max(1, chunks)
        assert bounds[0][0] == 0 and bounds[-1][1] == size
        assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:]))
        assert all(a % unit == 0 for a, _ in bounds)


def _wide_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 700), torch.nn.Tanh(), torch.nn.Linear(700, 3))


def _fingerprint(engine: Engine, model) -> list[torch.Tensor]:
    out = [flat_params(model)] + [v.clone() for _, v in sorted(engine.shard_state.tensors().items())]
    if engine.grads.feedback is not None:
        out += [v.clone() for _, v in sorted(engine.grads.feedback.state_dict().items())]
    return out


def _trajectories(rank: int, world: int) -> dict:
    out = {}
    for use_kernels in (True, False):
        kernels.use(use_kernels)
        # 5: the later pieces take two kept row slots in turn, and three scratch slots (step_copy)
        for chunks in (1, 3, 5):
            for name, kw in MODES.items():
                for step_copy in STEP_COPIES:
                    model = _wide_model()
                    cfg = EngineConfig(lr=3e-3, micro_batches=2, accumulation="fixed", max_steps=5,
                                       max_grad_norm=0.05, weight_decay=0.01, comm_chunks=chunks,
                                       step_copy=step_copy, **kw)
                    engine = Engine(model, cfg, mse_loss)
                    history = engine.fit(worker_stream(rank, 400))
                    out[(use_kernels, chunks, name, step_copy)] = (
                        _fingerprint(engine, model), [h["wire_bytes"] for h in history], kernels.available(),
                        engine.shard_state.step, _scratch_slots(engine))
                    engine.close()
    kernels.use(True)
    return out


def _scratch_slots(engine: Engine) -> tuple[int, int] | None:
    """(master slots, values in each) of the piece-sized scratch, None when there is none."""
    kept = engine.shard_state._scratch
    return None if kept is None else (len(kept[0]), kept[1].numel())


def test_pieces_kernels_and_step_copy_change_no_bit():
    results = spawn(_trajectories, 2, timeout=600)
    for rank_out in results:
        for name in MODES:
            ref, ref_bytes, _, ref_step, _ = rank_out[(False, 1, name, "whole")]
            for key in rank_out:
                if key[2] != name:
                    continue
                got, got_bytes, _, step, slots = rank_out[key]
                assert len(got) == len(ref), key
                for a, b in zip(got, ref):
                    assert torch.equal(a, b), key
                assert got_bytes == ref_bytes, key  # the same bytes on the wire, whatever the pieces
                assert step == ref_step == 5, key
                if key[3] == "piece":  # a slot per piece, three at most, each as long as the longest piece
                    chunks = key[1]
                    assert slots is not None and slots[0] == min(chunks, 3), (key, slots)
                else:
                    assert slots is None, key
    for name in MODES:  # and the replicas are identical
        for step_copy in STEP_COPIES:
            key = (True, 3, name, step_copy)
            assert torch.equal(results[0][key][0][0], results[1][key][0][0]), key
