"""Resume at another world size: save at 3 workers, load at 4 and at 2, then at 1 and grown back to 3.

The sharded master and moments are the same full vectors re-cut (torch.equal), the error-feedback
sum over workers is kept (spread evenly), DiLoCo keeps theta_sync and each survivor's own local
state, the global batch and the data position carry over, and training goes on, finite."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file

from engine import Engine, EngineConfig
from engine.batch.dealing import GlobalBatches
from engine.checkpoint.writer import rank_file
from engine.parallel.local_group import spawn
from tests.tiny import mse_loss, tiny_model, worker_stream

G = 8  # global micro-batches per step: acco runs 2 rounds of at least one per worker at 4 workers
CASES = {
    "zero1": dict(strategy="zero1", global_micro_batches=G),
    "acco_loco4": dict(strategy="acco", codec="loco4", group_size=8, global_micro_batches=G),
    "onebit": dict(strategy="onebit_adam", onebit_warmup_steps=2, global_micro_batches=G),
    "diloco": dict(strategy="diloco", inner_steps=2, micro_batches=1),
}
SAVED_AT = 4


def _cfg(name: str, steps: int) -> EngineConfig:
    return EngineConfig(**{**dict(lr=1e-2, accumulation="fixed", max_steps=steps, align=8, weight_decay=0.01),
                           **CASES[name]})


class Recorded:
    """A global stream that remembers which global micro-batches this rank fetched."""

    def __init__(self):
        self.data = worker_stream(0, 400)
        self.fetched: list[int] = []

    def __call__(self, i: int):
        self.fetched.append(i)
        return self.data[i]


def _batches(name, rank):
    return (GlobalBatches(Recorded()) if "global_micro_batches" in CASES[name]
            else worker_stream(rank, 400))


def _state(engine) -> dict:
    s = engine.shard_state
    out = {"master": s.master.clone(), "exp_avg": s.exp_avg.clone(), "exp_avg_sq": s.exp_avg_sq.clone(),
           "numel": engine.flat.numel, "step": engine.step}
    fb = getattr(engine.grads, "feedback", None)
    if fb is not None:
        out["feedback"] = fb.error()
    strategy = engine.strategy
    if getattr(strategy, "state", None) is not None and hasattr(strategy.state, "worker_error"):
        out["worker_error"] = strategy.state.worker_error.clone()
        out["server_error"] = strategy.state.server_error.clone()
    if hasattr(strategy, "theta_sync"):
        out["theta_sync"] = strategy.theta_sync.clone()
    return out


def first_run(rank, world, root):
    for name in CASES:
        e = Engine(tiny_model(0), _cfg(name, SAVED_AT), mse_loss)
        e.fit(_batches(name, rank))
        e.save(f"{root}/{name}/w{world}")
        e.close()


def resumed_run(rank, world, root, saved_world, more):
    logging.basicConfig(level=logging.WARNING)
    out = {}
    for name in CASES:
        e = Engine.load(f"{root}/{name}/w{saved_world}", tiny_model(7), _cfg(name, 100), mse_loss)
        loaded = _state(e)
        batches = _batches(name, rank)
        if isinstance(batches, GlobalBatches):
            batches = GlobalBatches(Recorded())
            recorded = batches._fetch
        else:
            recorded = None
            import itertools
            batches = itertools.islice(batches, e.consumed, None)
        h = e.fit(batches, steps=more)
        out[name] = {"loaded": loaded, "losses": [x["loss"] for x in h], "steps": [x["step"] for x in h],
                     "fetched": recorded.fetched if recorded else None,
                     "global_micro_batches": e.cfg.global_micro_batches}
        if world != 1:
            e.save(f"{root}/{name}/w{world}")
        e.close()
    return out


def _saved(root, name, world) -> list[dict]:
    return [load_file(f"{root}/{name}/w{world}/{rank_file(r, world)}") for r in range(world)]


def _full(files, key, numel):
    return torch.cat([f[key] for f in files])[:numel]


def _check(saved, per_rank, name, old_world, new_world):
    outs = [p[name] for p in per_rank]
    numel = outs[0]["loaded"]["numel"]
    for o in outs:
        assert o["loaded"]["step"] == SAVED_AT if old_world == 3 else True
        assert len(o["losses"]) == 2 and all(torch.isfinite(torch.tensor(o["losses"]))), (name, o["losses"])
    if name == "diloco":  # theta_sync kept; survivors keep their own local parameters
        for r, o in enumerate(outs):
            assert torch.equal(o["loaded"]["theta_sync"][:numel], saved[0]["outer.theta_sync"][:numel])
            expect = saved[r]["opt.master"] if r < old_world else saved[0]["outer.theta_sync"]
            assert torch.equal(o["loaded"]["master"][:numel], expect[:numel]), (r, old_world, new_world)
        return
    for key in ("master", "exp_avg", "exp_avg_sq"):  # the same full vectors, re-cut
        full = torch.cat([o["loaded"][key] for o in outs])[:numel]
        assert torch.equal(full, _full(saved, f"opt.{key}", numel)), (name, key)
    if name == "acco_loco4":  # the error sum kept: int8 codes, so up to one rounding per worker
        from engine.checkpoint.reshard import _feedback_error
        old = sum(_feedback_error({k[9:]: v for k, v in f.items() if k.startswith("feedback.")}, 8)[:numel]
                  for f in saved)
        new = sum(o["loaded"]["feedback"][:numel] for o in outs)
        assert old.abs().max() > 0
        step = old.abs().max() / 127 * new_world
        assert (new - old).abs().max() <= step, (new - old).abs().max()
        assert torch.equal(outs[0]["loaded"]["feedback"], outs[-1]["loaded"]["feedback"])  # spread evenly
    if name == "onebit":
        old = sum(f["onebit.worker_error"][:numel].double() for f in saved)
        new = sum(o["loaded"]["worker_error"][:numel].double() for o in outs)
        assert old.abs().max() > 0
        torch.testing.assert_close(new, old, rtol=0, atol=1e-6)
        full = torch.cat([o["loaded"]["server_error"] for o in outs])[:numel]
        assert torch.equal(full, _full(saved, "onebit.server_error", numel))
    # the global batch is the run's; the data position carries over: the next steps take exactly
    # the global micro-batches after the saved step's, whatever the new shares
    step = outs[0]["loaded"]["step"]
    fetched = sorted(i for o in outs for i in o["fetched"])
    assert outs[0]["global_micro_batches"] == G
    assert fetched[:2 * G] == list(range(step * G, (step + 2) * G)), (name, fetched)


def test_resume_at_fewer_then_more_workers(tmp_path, caplog):
    root = str(tmp_path)
    spawn(first_run, 3, root)
    three = {name: _saved(root, name, 3) for name in CASES}
    four = spawn(resumed_run, 4, root, 3, 2)  # grown: a new rank starts from the carried state
    for name in CASES:
        _check(three[name], four, name, 3, 4)
    two = spawn(resumed_run, 2, root, 3, 2)
    for name in CASES:
        _check(three[name], two, name, 3, 2)
    twos = {name: _saved(root, name, 2) for name in CASES}
    with caplog.at_level(logging.WARNING, logger="acco_loco"):
        one = resumed_run(0, 1, root, 2, 2)
    for name in CASES:
        _check(twos[name], [one], name, 2, 1)
    resize = [r.getMessage() for r in caplog.records if "resized" in r.getMessage()]
    assert any("written by 2 workers, this run has 1" in m and "dropped" in m and "error sum over 2 spread over 1"
               in m for m in resize), resize
    grown = spawn(resumed_run, 3, root, 2, 2)
    for name in CASES:
        _check(twos[name], grown, name, 2, 3)


def _local_cfg(root, rank, steps, **kw):
    return EngineConfig(strategy="acco", codec="loco4", group_size=8, lr=1e-2, micro_batches=2,
                        accumulation="fixed", max_steps=steps, align=8,
                        checkpoint_dir=f"{root}/node{rank}", **kw)  # a directory per rank: its own disk


def node_local_run(rank, world, root):
    straight = Engine(tiny_model(0), _local_cfg(f"{root}/straight", rank, 6), mse_loss)
    straight.fit(worker_stream(rank, 100))
    straight.close()
    first = Engine(tiny_model(0), _local_cfg(root, rank, 4, checkpoint_every=2), mse_loss)
    first.fit(worker_stream(rank, 100))
    first.close()
    resumed = Engine.load(f"{root}/node{rank}", tiny_model(3), None, mse_loss, max_steps=6)
    import itertools
    resumed.fit(itertools.islice(worker_stream(rank, 100), resumed.consumed, None))
    resumed.close()
    return {"same": torch.equal(torch.cat([p.detach().reshape(-1) for p in straight.model.parameters()]),
                                torch.cat([p.detach().reshape(-1) for p in resumed.model.parameters()]))}


def test_node_local_checkpoint_directories(tmp_path):
    """Without a shared filesystem each node's ranks write into their own directory with the same
    atomic protocol; each resumes from its own (bit-exact)."""
    out = spawn(node_local_run, 2, str(tmp_path))
    assert all(o["same"] for o in out)
    for r in range(2):
        node = tmp_path / f"node{r}"
        assert (node / "latest").read_text().strip() == "step-00000006"  # the resumed run saves too
        files = sorted(p.name for p in (node / "step-00000004").iterdir())
        # its own rank's file and a buddy copy of the other node's (tests/engine/test_checkpoint_peers.py)
        assert files == ["engine.json", "model.safetensors", "rank00000-of-00002.safetensors",
                         "rank00001-of-00002.safetensors"]
        assert not any(p.name.endswith(".tmp") for p in node.iterdir())
    # so one node's directory alone resumes at one worker (a re-cut of both ranks' state)
    assert Engine.load(str(tmp_path / "node0"), tiny_model(0), None, mse_loss).step == 6
