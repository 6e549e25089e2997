"""optimizer='muon' resumed at another world size (engine/checkpoint/recut_matrices.py; issue 43).

Each hidden matrix sits whole in one shard, placed for the world size (acco_loco/matrix_layout.py),
so a parameter's offset in the flat buffer differs between 2, 1 and 3 workers. A 2-worker zero1 or
acco run saves at a step boundary; it is resumed at 2 (the reference: a resume at the same world
size, itself bit-exact, tests/engine/test_muon.py), at 1 and at 3 workers, on the same global
micro-batches (GlobalBatches). ACCO's checkpoint holds a round's micro-batches computed ahead
(pending), which a re-cut drops and deals again on the loaded parameters, by design
(engine/checkpoint/reshard.py): its reference is the same checkpoint re-cut for its own 2 workers
(the identity on every state tensor, checked, with the pending micro-batches dealt again). Checked: the re-cut master, Muon momentum and AdamW moments read in
model order equal the saved ones value for value, and the continuation equals the reference:
bit for bit at 1 worker (two micro-batches a step: a + b summed in the same order) and within 1e-6
relative at 3 (six micro-batches summed over 3 workers instead of 2). With LoCo-4 the re-cut
keeps the sum of the workers' error feedback (in model order, up to one int8 rounding a worker)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.batch.dealing import GlobalBatches
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, rel_err, worker_stream

SAVED_AT, MORE, LR = 3, 3, 1e-2
DATA = worker_stream(0, 200)  # the global micro-batches, the same for every world size
pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")


def three_layers(seed: int = 0) -> torch.nn.Module:
    """Three hidden matrices (96, 128 and 24 values) and their biases, which the layout places at
    other offsets for 2 workers (W1 at 144, b1 at 128, W3 at 240) than for 1 or 3 (128, 248, 224)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


def _cfg(strategy: str, g: int, steps: int, **kw) -> EngineConfig:
    return EngineConfig(strategy=strategy, optimizer="muon", lr=LR, global_micro_batches=g, accumulation="fixed",
                        max_steps=steps, align=8, weight_decay=0.01, **kw)


def _state(engine) -> dict:
    s = engine.shard_state
    out = {"master": s.master.clone(), "exp_avg": s.exp_avg.clone(), "exp_avg_sq": s.exp_avg_sq.clone(),
           "offsets": list(engine.flat.offsets), "shard_size": engine.flat.shard_size}
    feedback = getattr(engine.grads, "feedback", None)
    if feedback is not None:  # this worker's LoCo error over the whole buffer, in this run's layout
        full = feedback.error().reshape(-1)
        out["feedback"] = torch.cat([full[a:b] for a, b in engine.flat.offsets])
    return out


def _save(rank: int, world: int, root: str, cases: dict):
    out = {}
    for name, (strategy, g, kw) in cases.items():
        engine = Engine(three_layers(), _cfg(strategy, g, SAVED_AT, **kw), mse_loss)
        engine.fit(GlobalBatches(DATA))
        engine.save(f"{root}/{name}")
        out[name] = _state(engine)
        engine.close()
    return out


def recut_at_own_world_size(monkeypatch_target) -> None:
    """Make Engine.load re-cut a checkpoint also for its own world size: every rank file read and
    passed through engine/checkpoint/reshard.py ``recut``, as at another world size."""
    from engine.checkpoint.files import read_rank_state
    from engine.checkpoint.peers import rank_file

    def rank_state(self, rank, world, recut):
        old = [read_rank_state(self.path / rank_file(r, world), self.checked) for r in range(world)]
        tensors, meta, _ = recut(old, f"the checkpoint in {self.path}")
        return tensors, meta, f"{self.path} (re-cut for its own {world} workers)"

    monkeypatch_target.rank_state = rank_state


def _resume(rank: int, world: int, root: str, cases: dict, by_recut: tuple = ()):
    from engine.checkpoint.load import OpenCheckpoint

    own = OpenCheckpoint.rank_state
    out = {}
    for name, (strategy, g, kw) in cases.items():
        OpenCheckpoint.rank_state = own
        if name in by_recut:
            recut_at_own_world_size(OpenCheckpoint)
        model = three_layers(seed=5)  # every value comes from the checkpoint
        engine = Engine.load(f"{root}/{name}", model, _cfg(strategy, g, SAVED_AT + MORE, **kw), mse_loss)
        loaded = _state(engine)
        engine.fit(GlobalBatches(DATA))
        out[name] = {"loaded": loaded, "params": flat_params(model), "step": engine.step}
        engine.close()
    OpenCheckpoint.rank_state = own
    return out


def _whole(states: list[dict], key: str) -> torch.Tensor:
    full = torch.cat([s[key] for s in states])
    return torch.cat([full[a:b] for a, b in states[0]["offsets"]])


def _check(saved: list[dict], resumed: list[dict], reference: list[dict], name: str, bound: float) -> None:
    new = [r[name]["loaded"] for r in resumed]
    old = [s[name] for s in saved]
    assert new[0]["offsets"] != old[0]["offsets"], "the layouts must differ for the re-cut to be tested"
    for key in ("master", "exp_avg", "exp_avg_sq"):  # value for value, each parameter where the new run keeps it
        assert torch.equal(_whole(new, key), _whole(old, key)), (name, key)
    assert _whole(old, "exp_avg").abs().sum() > 0
    for ref, own in zip(reference, old):  # the reference starts from the saved state itself
        assert all(torch.equal(ref[name]["loaded"][k], own[k]) for k in ("master", "exp_avg", "exp_avg_sq"))
    if "feedback" in old[0]:  # LoCo's error: the sum over the workers kept, one int8 rounding per new worker
        before, after = sum(o["feedback"] for o in old), sum(n["feedback"] for n in new)
        assert before.abs().max() > 0
        assert (after - before).abs().max() <= before.abs().max() / 127 * len(new), (after - before).abs().max()
        assert all(torch.equal(n["feedback"], new[0]["feedback"]) for n in new)  # spread evenly
        # the compressed exchange's rounding depends on the world size: the continuation is
        # checked for a finite run only (its exactness is the uncompressed cases')
        assert all(torch.isfinite(r[name]["params"]).all() and r[name]["step"] == SAVED_AT + MORE for r in resumed)
        return
    want = reference[0][name]["params"]
    print(f"{name} 2 -> {len(resumed)} workers: largest relative error against the reference "
          f"{max(rel_err(r[name]['params'], want) for r in resumed):.2e}")
    for r in resumed:
        assert r[name]["step"] == SAVED_AT + MORE
        if bound == 0:
            assert torch.equal(r[name]["params"], want), (name, rel_err(r[name]["params"], want))
        else:
            assert rel_err(r[name]["params"], want) <= bound, (name, rel_err(r[name]["params"], want))
    assert not torch.equal(want, _whole(old, "master")[:want.numel()])  # the continuation moved the model


CASES = {"zero1": ("zero1", 2, {}), "acco": ("acco", 4, {})}  # acco: two rounds of at least one per worker
WIDE = {"zero1": ("zero1", 6, {}), "acco": ("acco", 6, {}),
        "acco_loco4": ("acco", 6, {"codec": "loco4", "param_codec": "int8", "group_size": 8})}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_muon_checkpoint_of_2_workers_resumes_at_1_bit_for_bit(tmp_path):
    root = str(tmp_path)
    saved = spawn(_save, 2, root, CASES, timeout=300)
    reference = spawn(_resume, 2, root, CASES, ("acco",), timeout=300)
    one = [_resume(0, 1, root, CASES)]
    for name in CASES:
        _check(saved, one, reference, name, 0.0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_muon_checkpoint_of_2_workers_resumes_at_3(tmp_path):
    root = str(tmp_path)
    saved = spawn(_save, 2, root, WIDE, timeout=300)
    reference = spawn(_resume, 2, root, WIDE, ("acco",), timeout=300)
    three = spawn(_resume, 3, root, WIDE, timeout=300)
    for name in WIDE:
        _check(saved, three, reference, name, 1e-6)


# ---------------------------------------------------------------- the relayout alone, one process
def _flat_at(world: int):
    from engine.core.flat import FlatParams

    named = list(three_layers().named_parameters())  # Muon's matrices: the 2-D weights
    return FlatParams([p for _, p in named], [n for n, _ in named], world, 8, torch.float32,
                      whole=[p.ndim == 2 for _, p in named])


def test_matrix_order_reads_the_old_placement_and_writes_the_new():
    from types import SimpleNamespace

    from engine.checkpoint.recut_matrices import matrix_order

    old, new = _flat_at(2), _flat_at(3)
    assert old.offsets != new.offsets
    values = torch.arange(1, old.numel + 1, dtype=torch.float32)  # each value its own model-order index
    ctx = SimpleNamespace(flat=new, cfg=EngineConfig(optimizer="muon", align=8))
    order = matrix_order(ctx, 2)
    assert order.old_shard_size == old.shard_size
    assert torch.equal(order.values(old.spread(values)), values)
    assert torch.equal(order.place(values), new.spread(values))
    padding = [i for i in range(new.padded) if not any(a <= i < b for a, b in new.offsets)]
    assert torch.equal(order.place(values, fill=-1)[padding], torch.full((len(padding),), -1.0))  # the rule's fill


def test_a_checkpoint_whose_shards_the_placement_does_not_give_is_refused():
    from types import SimpleNamespace

    from engine.checkpoint.reshard import ReshardError, recut
    from engine.strategies import strategy_class

    new = _flat_at(1)
    ctx = SimpleNamespace(flat=new, comm=SimpleNamespace(rank=0, world_size=1),
                          cfg=EngineConfig(optimizer="muon", align=8))
    meta = {"numel": new.numel, "shard_size": 100, "round_index": 3, "topology": "flat"}  # the placement: 144
    old = [({"opt.master": torch.zeros(100)}, {**meta, "rank": r}) for r in range(2)]
    with pytest.raises(ReshardError, match="holds shards of 100 values, but placing this model's matrices for its "
                                           "2 workers gives 144"):
        recut(ctx, strategy_class("zero1"), "flat", old, "the checkpoint")
