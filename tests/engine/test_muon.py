"""optimizer='muon' on the sharded optimizer (acco_loco/muon.py, acco_loco/matrix_layout.py):
torch.optim.Muon on the hidden matrices and AdamW on the rest, each matrix whole on its owner.
Against a float64 single-process reference of the same split (tests/tiny.py MuonAdamW: torch's
Muon and AdamW) for zero1, dpu and acco at world 1 and 2, with pipelined pieces that cut through
matrices; the layout; a bit-exact resume; and the refusals."""

from __future__ import annotations

import pytest
import torch

from acco_loco.matrix_layout import place
from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

K, STEPS, LR = 2, 6, 1e-2
pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")


def _engine(strategy: str, opt: str = "muon", **kw) -> Engine:
    cfg = EngineConfig(strategy=strategy, optimizer=opt, lr=LR, micro_batches=K, max_steps=STEPS, align=8, **kw)
    return Engine(tiny_model(), cfg, mse_loss)


def _run(rank, world, strategy, kw):
    engine = _engine(strategy, **kw)
    engine.fit(worker_stream(rank, 3 * K * (STEPS + 1)))
    engine.close()
    return flat_params(engine.model), engine.flat.matrices, engine.flat.shard_size


def _reference(world: int, strategy: str, opt: str = "muon") -> torch.Tensor:
    streams = [worker_stream(r, 3 * K * (STEPS + 1)) for r in range(world)]
    return Reference(tiny_model(), streams, K, opt=opt, lr=LR).run(strategy, STEPS)[-1]


# ---------------------------------------------------------------- the layout
@pytest.mark.parametrize("world,unit", [(1, 8), (2, 8), (3, 16), (8, 8)])
def test_no_whole_parameter_crosses_a_shard_boundary(world, unit):
    sizes = [96, 16, 48, 3, 700, 64, 64, 5, 300, 1]
    whole = [True, False, True, False, False, True, True, False, True, False]
    offsets, shard = place(sizes, whole, world, unit)
    assert shard % unit == 0 and all(o + n <= world * shard for o, n in zip(offsets, sizes))
    spans = sorted((o, o + n) for o, n in zip(offsets, sizes))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    for o, n, w in zip(offsets, sizes, whole):
        if w:
            assert o // shard == (o + n - 1) // shard, (o, n, shard)


def test_with_enough_values_to_cut_the_layout_pads_no_more_than_an_ordinary_one():
    sizes, whole = [4096] * 6 + [50_000, 512], [True] * 6 + [False, False]
    _, shard = place(sizes, whole, 4, 128)
    assert shard == -(-sum(sizes) // (4 * 128)) * 128


def test_the_hidden_matrices_are_the_2d_weights_not_embeddings_nor_the_head():
    from engine.core.context import hidden_matrices
    from lm.models import tiny_gpt2

    model = tiny_gpt2(n_layer=1, n_embd=16, n_head=2, n_positions=8)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    picked = {n for (n, _), w in zip(named, hidden_matrices(model, named)) if w}
    assert picked == {n for n, p in named if p.ndim == 2 and ".h." in n}  # attention and MLP weights
    assert not any("wte" in n or "wpe" in n for n in picked)


# ---------------------------------------------------------------- against the float64 reference
@pytest.mark.parametrize("strategy", ["zero1", "dpu", "acco"])
def test_world1_matches_torch_muon_and_adamw_in_float64(strategy):
    got, matrices, _ = _run(0, 1, strategy, {})
    assert len(matrices) == 2  # both Linear weights; the biases take AdamW's step
    assert rel_err(got, _reference(1, strategy)) < 1e-5
    assert rel_err(got, _reference(1, strategy, opt="adamw")) > 1e-2  # the check tells Muon from AdamW


def _world2(rank, world):
    out = {}
    for strategy in ("zero1", "dpu", "acco"):
        for chunks in (1, 3):  # 3 pieces cut through the shard's matrices
            out[(strategy, chunks)] = _run(rank, world, strategy, {"comm_chunks": chunks})
    return out


def test_world2_owners_step_whole_matrices_and_match_the_reference():
    r0, r1 = spawn(_world2, 2, timeout=300)
    for (strategy, chunks), (params, matrices, shard) in r0.items():
        assert torch.equal(params, r1[(strategy, chunks)][0])  # replicas bit-identical
        assert all(a // shard == (a + rows * cols - 1) // shard for a, rows, cols in matrices)
        assert {a // shard for a, _, _ in matrices} == {0, 1}  # each rank owns a matrix
        assert rel_err(params, _reference(2, strategy)) < 1e-5, (strategy, chunks)
    assert torch.equal(r0[("acco", 1)][0], r0[("acco", 3)][0])  # pieces do not change the bits


def _two_level(rank, world):
    engine = _engine("acco", codec="loco4", group_size=8)
    engine.fit(worker_stream(rank, 3 * K * (STEPS + 1)))
    engine.close()
    plain = _run(rank, world, "acco", {})
    return engine.topology, flat_params(engine.model), plain


def test_two_level_2x2_owners_step_whole_matrices():
    out = spawn(_two_level, 4, timeout=300, env={"LOCAL_WORLD_SIZE": "2"})
    assert {topology for topology, _, _ in out} == {"two_level"}
    assert all(torch.equal(out[0][1], o[1]) and torch.equal(out[0][2][0], o[2][0]) for o in out)
    assert rel_err(out[0][2][0], _reference(4, "acco")) < 1e-5  # the node sums in fp32, then the rails


# ---------------------------------------------------------------- codecs, checkpoints, refusals
def _compressed_and_resumed(rank, world, root):
    kw = {"codec": "loco4", "param_codec": "int4", "group_size": 8}
    engine = _engine("acco", **kw)
    stream = worker_stream(rank, 3 * K * (STEPS + 1))
    engine.fit(stream, steps=STEPS // 2)
    engine.save(root)
    rest = stream[engine.consumed:]
    engine.fit(rest)
    engine.close()
    whole = flat_params(engine.model)
    resumed = Engine.load(root, tiny_model(), loss_fn=mse_loss)
    resumed.fit(stream[resumed.consumed:])
    resumed.close()
    return {"whole": whole, "resumed": flat_params(resumed.model),
            "losses": [h["loss"] for h in engine.history]}


def test_muon_with_loco4_and_int4_deltas_resumes_bit_exact(tmp_path):
    r0, r1 = spawn(_compressed_and_resumed, 2, str(tmp_path / "ckpt"), timeout=300)
    assert torch.equal(r0["whole"], r1["whole"]) and torch.equal(r0["resumed"], r0["whole"])
    assert r0["losses"][-1] < r0["losses"][0]


@pytest.mark.parametrize("kw,fragment", [
    ({"strategy": "diloco"}, "optimizer='muon' with strategy 'diloco'"),
    ({"strategy": "onebit_adam"}, "optimizer='muon' with strategy 'onebit_adam'"),
    # its matrices reach past a piece: the step goes into the whole spare
    ({"step_copy": "piece"}, "step_copy='piece' with optimizer='muon'"),
])
def test_what_muon_does_not_run_with_is_refused(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineConfig(optimizer="muon", **kw)


def test_muon_keeps_the_whole_spare_where_auto_takes_piece_scratch():
    from engine.strategies.spec import resolve_step_copy

    assert resolve_step_copy("auto", cuda=True) == "piece"
    assert resolve_step_copy("auto", cuda=True, optimizer="muon") == "whole"
    assert resolve_step_copy("auto", cuda=False) == "whole"
    assert resolve_step_copy("whole", cuda=True) == "whole"
