"""Checkpoints without a shared filesystem: each node's directory keeps its own ranks' files and a
buddy copy of the next node's; a lost node's directory is survived, from the buddy copies on the
live ranks' disks, sent over the process group (separate directories stand in for separate disks).

3 workers, one directory each (node0, node1, node2): node i keeps ranks i and i + 1 (mod 3)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine import Engine, EngineConfig
from engine.batch.dealing import GlobalBatches
from engine.checkpoint.peers import buddy_of, buddy_sources, choose
from engine.checkpoint.writer import rank_file
from engine.parallel.local_group import spawn, spawn_collect
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

G = 6  # global micro-batches per step
SAVED, FINAL = 4, 6


def _cfg(root, disk: str, steps: int, **kw) -> EngineConfig:
    return EngineConfig(strategy="acco", codec="loco4", group_size=8, lr=1e-2, accumulation="fixed",
                        global_micro_batches=G, max_steps=steps, align=8, checkpoint_dir=f"{root}/{disk}", **kw)


def _stream():
    return GlobalBatches(worker_stream(0, 400))


def first_run(rank, world, root):
    straight = Engine(tiny_model(0), _cfg(f"{root}/straight", f"node{rank}", FINAL), mse_loss)
    straight.fit(_stream())
    straight.close()
    run = Engine(tiny_model(0), _cfg(root, f"node{rank}", SAVED, checkpoint_every=2), mse_loss)
    run.fit(_stream())
    run.close()
    return flat_params(straight.model)


def resume(rank, world, root, disks):
    """Resume on ``disks[rank]`` (a node's directory, possibly empty: a replacement node)."""
    e = Engine.load(f"{root}/{disks[rank]}", tiny_model(3), _cfg(root, disks[rank], FINAL, checkpoint_every=2),
                    mse_loss)
    s = e.shard_state
    loaded = {"master": s.master.clone(), "exp_avg": s.exp_avg.clone(), "exp_avg_sq": s.exp_avg_sq.clone(),
              "error": e.grads.feedback.error().clone(), "step": e.step, "numel": e.flat.numel}
    e.fit(_stream())
    e.close()
    return {"loaded": loaded, "params": flat_params(e.model), "step": e.step}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    straight = spawn(first_run, 3, str(root))
    return root, straight


def _copy(saved, tmp_path):
    root, straight = saved
    dst = tmp_path / "run"
    shutil.copytree(root, dst, symlinks=True)
    return dst, straight


def test_each_node_keeps_its_files_and_a_buddy_copy(saved):
    root, _ = saved
    for node in range(3):
        files = sorted(p.name for p in (root / f"node{node}" / f"step-{SAVED:08d}").iterdir())
        kept = sorted({node, (node + 1) % 3})
        assert files == ["engine.json", "model.safetensors", *[rank_file(r, 3) for r in kept]], (node, files)
    # a buddy copy is the same file, byte for byte
    for node in range(3):
        r = (node + 1) % 3
        own = root / f"node{r}" / f"step-{SAVED:08d}" / rank_file(r, 3)
        copy = root / f"node{node}" / f"step-{SAVED:08d}" / rank_file(r, 3)
        assert own.read_bytes() == copy.read_bytes()


def test_a_replacement_node_resumes_bit_exactly_from_its_buddy(saved, tmp_path):
    """node1's disk is lost; a fresh node takes rank 1 with an empty directory: it gets engine.json,
    the model and its rank file from the live peers, and the run ends where the straight one does."""
    root, straight = _copy(saved, tmp_path)
    shutil.rmtree(root / "node1")
    out = spawn(resume, 3, str(root), ["node0", "node1", "node2"])
    for r in range(3):
        assert out[r]["step"] == FINAL
        assert torch.equal(out[r]["params"], straight[r]), r
    # the replacement node writes its own files (and its buddy copy) again
    files = sorted(p.name for p in (root / "node1" / f"step-{FINAL:08d}").iterdir())
    assert files == ["engine.json", "model.safetensors", rank_file(1, 3), rank_file(2, 3)]


def test_survivors_of_a_lost_node_resume_at_world_2_from_buddy_copies(saved, tmp_path):
    """node1's disk is lost with its worker: the two survivors re-cut the 3-worker state, rank 0
    (node0: ranks 0, 1) and rank 1 (node2: ranks 2, 0) sending each other what they lack. The
    master and moments are the saved full vectors re-cut (torch.equal), the error sum is kept."""
    root, _ = _copy(saved, tmp_path)
    saved_files = [load_file(root / f"node{(r + 2) % 3}" / f"step-{SAVED:08d}" / rank_file(r, 3)) for r in range(3)]
    shutil.rmtree(root / "node1")
    out = spawn(resume, 2, str(root), ["node0", "node2"])
    numel = out[0]["loaded"]["numel"]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        full = torch.cat([o["loaded"][key] for o in out])[:numel]
        assert torch.equal(full, torch.cat([f[f"opt.{key}"] for f in saved_files])[:numel]), key
    assert torch.equal(out[0]["loaded"]["error"], out[1]["loaded"]["error"])  # the sum, spread evenly
    assert all(o["loaded"]["step"] == SAVED and o["step"] == FINAL for o in out)
    assert torch.equal(out[0]["params"], out[1]["params"])
    assert torch.isfinite(out[0]["params"]).all()


def test_a_lost_node_and_its_buddy_are_named_on_every_rank(saved, tmp_path):
    """node0 and node1 lost: rank 1's file was on those two disks only."""
    root, _ = _copy(saved, tmp_path)
    shutil.rmtree(root / "node0")
    shutil.rmtree(root / "node1")
    (root / "fresh").mkdir()
    out = spawn_collect(resume, 2, str(root), ["node2", "fresh"], timeout=90)
    for o in out:
        assert o["status"] == "error", o
        assert "lacks" in o["out"] and rank_file(1, 3) in o["out"] and "buddy" in o["out"], o["out"]


def test_buddy_assignment_is_a_ring_of_directory_groups():
    owners = [0, 0, 2, 2, 4, 4]  # three nodes of two ranks
    assert [buddy_of(owners, r) for r in range(6)] == [4, 4, 0, 0, 2, 2]
    assert buddy_sources(owners, 0) == [2, 3] and buddy_sources(owners, 1) == []
    assert buddy_sources(owners, 4) == [0, 1]
    assert buddy_of([0, 0, 0], 1) is None and buddy_sources([0, 0, 0], 0) == []  # a shared filesystem


def test_the_latest_complete_checkpoint_is_chosen():
    def inv(latest, **ckpts):
        return {"latest": latest, "checkpoints": {n: {"step": s, "world": 2, "files": dict.fromkeys(f, 1)}
                                                  for n, (s, f) in ckpts.items()}}
    whole = ["engine.json", "model.safetensors", rank_file(0, 2), rank_file(1, 2)]
    half = ["engine.json", "model.safetensors", rank_file(0, 2)]
    # node 1 finished step 4 but died before step 4 was renamed on node 0: step 2 is the last whole one
    a = inv("step-2", **{"step-2": (2, whole)})
    b = inv("step-4", **{"step-2": (2, whole), "step-4": (4, half)})
    assert choose([a, b], "ckpt")[0] == "step-2"
    assert choose([a, a], "ckpt")[0] == "step-2"
    with pytest.raises(FileNotFoundError, match="no checkpoint in ckpt on any rank"):
        choose([inv(None), inv(None)], "ckpt")


def test_one_worker_cannot_recut_from_one_node_directory(saved):
    """At world 1 there is no peer to send node0's missing rank file: refused, naming what it holds."""
    root, _ = saved
    with pytest.raises(ValueError, match=r"node-local: it holds the files of ranks \[0, 1\] of 3"):
        Engine.load(str(root / "node0"), tiny_model(3), None, mse_loss)
