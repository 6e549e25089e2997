"""Checkpoint defects: a peer lost during a save is named, corrupt data is refused with the file and
tensor named, and Engine.load(dir, model, loss_fn=..., max_steps=...) resumes as a user expects."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import Engine, EngineConfig
from engine.checkpoint.writer import resolve
from engine.parallel.local_group import spawn, spawn_collect
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

TIMEOUT_S = 8.0
RANK0 = "rank00000-of-00001.safetensors"


def _cfg(steps: int = 4, **kw) -> EngineConfig:
    return EngineConfig(strategy="acco", lr=1e-2, micro_batches=2, accumulation="fixed", max_steps=steps,
                        align=8, **kw)


def _header(file: Path) -> tuple[int, dict]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def flip_tensor_byte(file: Path, tensor: str) -> None:
    """Flip one byte in the middle of ``tensor``'s data (not its header entry)."""
    n, header = _header(file)
    start, end = header[tensor]["data_offsets"]
    assert end > start, f"{tensor} has no data to corrupt"
    at = 8 + n + (start + end) // 2
    raw = bytearray(file.read_bytes())
    raw[at] ^= 0x5A
    file.write_bytes(bytes(raw))


# ---------------------------------------------------------------------------- item 5: corrupt data
@pytest.fixture(scope="module")
def loco_ckpt(tmp_path_factory) -> Path:
    """A world-1 acco + loco4 checkpoint: model, master, moments and LoCo error codes/scales."""
    root = tmp_path_factory.mktemp("loco") / "ckpt"
    engine = Engine(tiny_model(0), _cfg(codec="loco4", group_size=8), mse_loss)
    engine.fit(worker_stream(0, 50))
    engine.save(str(root))
    engine.close()
    return root


@pytest.fixture
def ckpt_copy(loco_ckpt, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(loco_ckpt, dst)
    return dst


def _load(path: Path, **kw) -> Engine:
    return Engine.load(str(path), tiny_model(3), None, mse_loss, **kw)


def test_intact_checkpoint_loads_and_stores_checksums(ckpt_copy):
    info = json.loads((ckpt_copy / "engine.json").read_text())
    assert info["checksums"] == "blake2b-128" and info["loss_fn"] == "tests.tiny.mse_loss"
    for name in ("model.safetensors", RANK0):
        with safe_open(str(ckpt_copy / name), "pt") as f:
            sums = json.loads(f.metadata()["checksums"])
            assert set(sums["tensors"]) == set(f.keys())
    _load(ckpt_copy).close()


@pytest.mark.parametrize("file,tensor", [
    ("model.safetensors", "0.weight"),
    ("model.safetensors", "2.bias"),
    (RANK0, "opt.master"),
    (RANK0, "opt.exp_avg_sq"),
    (RANK0, "feedback.e_codes"),
    (RANK0, "feedback.e_scales"),
])
def test_flipped_byte_in_tensor_data_names_file_and_tensor(ckpt_copy, file, tensor):
    flip_tensor_byte(ckpt_copy / file, tensor)
    with pytest.raises(ValueError) as err:
        _load(ckpt_copy)
    msg = str(err.value)
    assert file in msg and f"tensor {tensor!r} fails its checksum (the file is corrupt)" in msg, msg
    assert "use an earlier checkpoint" in msg


def test_truncated_file_and_broken_header_are_clear(ckpt_copy, tmp_path):
    rank = ckpt_copy / RANK0
    good = rank.read_bytes()
    rank.write_bytes(good[:len(good) - 7])  # truncated inside the last tensor
    with pytest.raises(ValueError, match=rf"{RANK0} is corrupt or unreadable .*use an earlier checkpoint"):
        _load(ckpt_copy)
    broken = bytearray(good)
    broken[3] ^= 0x01  # the header length
    rank.write_bytes(bytes(broken))
    with pytest.raises(ValueError, match=rf"{RANK0} is corrupt or unreadable"):
        _load(ckpt_copy)
    model = ckpt_copy / "model.safetensors"
    model.write_bytes(model.read_bytes()[:40])
    rank.write_bytes(good)
    with pytest.raises(ValueError, match=r"model.safetensors is corrupt or unreadable"):
        _load(ckpt_copy)


def _rewrite(file: Path, edit_meta) -> None:
    with safe_open(str(file), "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(file), metadata=edit_meta(meta))


def test_edited_metadata_or_dropped_checksums_are_refused(ckpt_copy):
    rank = ckpt_copy / RANK0
    good = rank.read_bytes()

    def bump_step(meta):
        engine_meta = json.loads(meta["engine"])
        engine_meta["consumed"] += 1
        return {**meta, "engine": json.dumps(engine_meta)}

    _rewrite(rank, bump_step)
    with pytest.raises(ValueError, match=rf"{RANK0}: metadata 'engine' fails its checksum"):
        _load(ckpt_copy)
    rank.write_bytes(good)
    _rewrite(rank, lambda meta: {k: v for k, v in meta.items() if k != "checksums"})
    with pytest.raises(ValueError, match=rf"{RANK0} has no checksums though its checkpoint was written with them"):
        _load(ckpt_copy)


def test_checkpoint_without_checksums_loads_with_a_warning(ckpt_copy, caplog):
    """Written before checksums existed: nothing to verify, so it loads and says so."""
    for name in ("model.safetensors", RANK0):
        _rewrite(ckpt_copy / name, lambda meta: {k: v for k, v in meta.items() if k != "checksums"})
    info = json.loads((ckpt_copy / "engine.json").read_text())
    del info["checksums"], info["loss_fn"]
    (ckpt_copy / "engine.json").write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING, logger="acco_loco"):
        engine = _load(ckpt_copy)
    assert engine.step == 4
    engine.close()
    assert "written before checkpoints carried checksums" in caplog.text


def save_loco_world2(rank: int, world: int, root: str):
    engine = Engine(tiny_model(0), _cfg(codec="loco4", group_size=8), mse_loss)
    engine.fit(worker_stream(rank, 50))
    engine.save(root)
    engine.close()


def load_world2(rank: int, world: int, root: str):
    engine = Engine.load(root, tiny_model(3), None, mse_loss)
    step = engine.step
    engine.close()
    return step


def test_world2_corrupt_rank1_file_stops_every_rank(tmp_path):
    root = tmp_path / "w2"
    spawn(save_loco_world2, 2, str(root))
    rank1 = "rank00001-of-00002.safetensors"
    with safe_open(str(root / rank1), "pt") as f:
        assert any(k.startswith("feedback.") for k in f.keys())
    flip_tensor_byte(root / rank1, "opt.exp_avg_sq")
    out = spawn_collect(load_world2, 2, str(root), timeout=60)
    assert out[1]["status"] == "error", out[1]
    assert f"{rank1}: tensor 'opt.exp_avg_sq' fails its checksum (the file is corrupt)" in out[1]["out"]
    # rank 0's own file is intact: it learns of rank 1's failure instead of training on alone
    assert out[0]["status"] == "error", out[0]
    assert "rank(s) [1] could not load their part of the checkpoint" in out[0]["out"], out[0]["out"]


# ---------------------------------------------------------------------------- item 4: lost during save
def dies_in_save(rank: int, world: int, root: str, victim: int):
    import engine.checkpoint.files as ckpt  # the module that writes the files

    real = ckpt.save_file

    def save_file_or_die(tensors, filename, metadata=None):
        if rank == victim and "step-00000006" in str(filename):  # the second periodic save
            with open(f"{root}.failed_at", "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(tensors, filename, metadata=metadata)

    ckpt.save_file = save_file_or_die
    cfg = _cfg(1000, timeout_s=TIMEOUT_S, heartbeat_s=0.5, checkpoint_dir=root, checkpoint_every=3)
    engine = Engine(tiny_model(0), cfg, mse_loss)
    try:
        engine.fit(worker_stream(rank, 5000))
    except Exception as exc:
        raise RuntimeError(f"detected_at={time.time()!r} after step {engine.step}: {exc}") from exc
    return "finished"


def test_peer_lost_during_save_is_named_and_no_partial_checkpoint_resolves(tmp_path):
    root = tmp_path / "run"
    victim = 2
    out = spawn_collect(dies_in_save, 3, str(root), victim, timeout=8 * TIMEOUT_S)
    assert out[victim]["exitcode"] == -signal.SIGKILL, out[victim]
    failed = float(Path(f"{root}.failed_at").read_text())
    for r in (0, 1):
        text = out[r]["out"]
        assert out[r]["status"] == "error", out[r]
        assert f"checkpoint save to {root / 'step-00000006'} on rank {r} failed: lost rank(s) [{victim}]" \
            in text, text
        detected = float(text.split("detected_at=")[1].split()[0])
        assert 0 < detected - failed < TIMEOUT_S + 3, detected - failed
    # the unfinished save is never taken for a checkpoint; the root still resolves to step 3
    assert not (root / "step-00000006").exists()
    assert resolve(root) == root / "step-00000003"
    if (root / "step-00000006.tmp").exists():
        with pytest.raises(FileNotFoundError, match="unfinished checkpoint"):
            resolve(root / "step-00000006.tmp")


def test_tmp_dir_never_resolves_even_when_it_looks_complete(loco_ckpt, tmp_path):
    tmp = tmp_path / "ckpt.tmp"
    shutil.copytree(loco_ckpt, tmp)  # every file there, engine.json included
    with pytest.raises(FileNotFoundError, match="unfinished checkpoint"):
        resolve(tmp)


# ---------------------------------------------------------------------------- item 6: the documented load
N = 4


@pytest.fixture(scope="module")
def custom_loss_ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loss") / "ckpt"
    engine = Engine(tiny_model(0), _cfg(N), mse_loss)
    engine.fit(worker_stream(0, 100))
    assert engine.step == N
    engine.save(str(root))
    engine.close()
    return root


def test_load_without_the_custom_loss_is_refused(custom_loss_ckpt):
    with pytest.raises(ValueError, match=r"was trained with loss_fn 'tests.tiny.mse_loss'; pass loss_fn=\.\.\. "
                                         r"to Engine.load \(the default, model\(\*\*batch\).loss, is used only"):
        Engine.load(str(custom_loss_ckpt), tiny_model(3))


def test_load_with_max_steps_trains_on_bit_exactly(custom_loss_ckpt):
    stream = worker_stream(0, 100)
    straight = Engine(tiny_model(0), _cfg(N + 3), mse_loss)  # constant lr: the horizon changes nothing
    straight.fit(stream)
    straight.close()

    model = tiny_model(3)
    resumed = Engine.load(str(custom_loss_ckpt), model, loss_fn=mse_loss, max_steps=N + 3)
    assert resumed.step == N and resumed.cfg.max_steps == N + 3
    history = resumed.fit(itertools.islice(stream, resumed.consumed, None))
    resumed.close()
    assert [h["step"] for h in history] == [N + 1, N + 2, N + 3]
    assert torch.equal(flat_params(model), flat_params(straight.model))


@pytest.mark.parametrize("bad", [N, N - 1, 0, -5, True, float(N + 3), "7"])
def test_max_steps_not_beyond_the_saved_step_is_refused(custom_loss_ckpt, bad):
    with pytest.raises(ValueError, match=rf"max_steps={bad!r}, but the checkpoint in .* is at step {N}: "
                                         rf"pass the total to train to, an integer above {N}"):
        Engine.load(str(custom_loss_ckpt), tiny_model(3), loss_fn=mse_loss, max_steps=bad)


def test_max_steps_overrides_a_given_cfg(custom_loss_ckpt):
    engine = Engine.load(str(custom_loss_ckpt), tiny_model(3), _cfg(N), mse_loss, max_steps=N + 5)
    assert engine.cfg.max_steps == N + 5
    engine.close()


def other_loss(model, batch):
    return mse_loss(model, batch)


def test_other_loss_name_warns_default_loss_needs_none(custom_loss_ckpt, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="acco_loco"):
        Engine.load(str(custom_loss_ckpt), tiny_model(3), loss_fn=other_loss).close()
    assert f"trained with loss_fn 'tests.tiny.mse_loss' and this run uses '{__name__}.other_loss'" \
        in caplog.text
    # a run on the default loss records none, and loads without one
    default = Engine(tiny_model(0), _cfg(N))
    default.save(str(tmp_path / "default"))
    default.close()
    assert json.loads((tmp_path / "default" / "engine.json").read_text())["loss_fn"] is None
    Engine.load(str(tmp_path / "default"), tiny_model(3)).close()
