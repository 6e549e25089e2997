"""Checkpoints in safetensors: the model once, and one file per rank for its shard and state.

Layout of a checkpoint directory:
    model.safetensors           the compute parameters every replica holds (rank 0 writes it)
    rank00001-of-00003.safetensors
                                that rank's fp32 master shard, optimizer moments, the gradient it
                                accumulated but has not sent yet, the reduced estimate half it
                                keeps (acco), its RNG state; engine counters in the metadata
    engine.json                 world size, step, config, the loss function's name; written last

Every rank writes into ``<dir>.tmp``; after a barrier rank 0 renames it to ``<dir>``, so a
checkpoint is either complete or absent. Without a shared filesystem (or with a directory per
node) the lowest rank that sees a directory finishes it: each node keeps its own ranks' files and
resumes from them at the same world size. A checkpoint
of N workers loads at another world size: every rank reads all N rank files and re-cuts them
(engine/reshard.py). A peer lost
during a save is named (the watchdog's diagnosis), and ``<dir>.tmp`` is never loaded.

Every safetensors file carries a checksum of each tensor and of its metadata (metadata key
``checksums``); load verifies them, so a flipped bit is an error that names the file and the
tensor instead of a run that trains on garbage. Checkpoints written before checksums existed
load with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_bytes
from safetensors.torch import save_file


from . import checkpoint_peers as peers
from . import reshard
from .checkpoint_peers import LATEST, rank_file
from .config import STRUCTURAL_FIELDS, EngineConfig
from .context import start_process_group, trainable_parameters
from .loss import default_loss

log = logging.getLogger("acco_loco")

FORMAT = 1  # checksums and loss_fn are optional additions: format-1 readers ignore them
CHECKSUMS = "checksums"  # safetensors metadata key (and engine.json field: the algorithm)
CHECKSUM_ALGO = "blake2b-128"
DEFAULT_LOSS = f"{default_loss.__module__}.{default_loss.__qualname__}"  # recorded as null
_UNRECORDED = object()  # engine.json of a checkpoint written before loss_fn was recorded


def save(engine, directory: str | os.PathLike) -> str:
    finish_pending(engine)  # a periodic save still being written finishes first
    path, owner = _save(engine, directory)
    return path


class _Pending:
    """A save whose files are written (``write``), then finished on every rank: a barrier, the
    lowest rank that sees the directory writes engine.json and renames it, ``then`` (the owner:
    the ``latest`` pointer), a barrier. In the background the write runs on its own thread from a
    copy of the state, and the finish waits for the next save or close (both are points with no
    round in flight, where the compute side may use the process group)."""

    def __init__(self, engine, final: Path, tmp: Path, owner: bool, sharing: list[int], info: dict | None,
                 then=None):
        self.engine, self.final, self.tmp, self.owner, self.sharing = engine, final, tmp, owner, sharing
        self.info, self.then = info, then
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.write_s = 0.0

    def start(self, write) -> None:
        def run():
            t0 = time.perf_counter()
            try:
                write()
            except BaseException as exc:  # raised on the compute side when the save is finished
                self.error = exc
            self.write_s = time.perf_counter() - t0
        self.thread = threading.Thread(target=run, name="acco-loco-checkpoint", daemon=True)
        self.thread.start()

    def finish(self) -> str:
        engine, final, tmp = self.engine, self.final, self.tmp
        what = f"checkpoint save to {final} on rank {engine.comm.rank}"
        if self.thread is not None:
            self.thread.join()
            if self.error is not None:
                raise RuntimeError(f"writing the checkpoint {final} failed on rank {engine.rank}") from self.error
        _barrier(engine, what)
        if self.owner:
            if len(self.sharing) < engine.comm.world_size:  # node-local directories: these ranks' files
                self.info["ranks_here"] = self.sharing
            for marker in tmp.glob(".present-*"):
                marker.unlink()
            with open(tmp / "engine.json", "w") as f:
                json.dump(self.info, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            old = final.with_name(final.name + ".old")
            if final.exists():
                if old.exists():
                    shutil.rmtree(old)
                final.rename(old)
            tmp.rename(final)
            if old.exists():
                shutil.rmtree(old)
            if self.then is not None:
                self.then()
        _barrier(engine, what)
        return str(final)


def _save(engine, directory: str | os.PathLike, background: bool = False, then=None):
    """(the checkpoint directory, whether this rank finished it), or with ``background`` the
    pending save (files written on a thread from a copy). The lowest rank that sees a directory
    writes its model and engine.json and renames it, so ranks with a shared filesystem write one
    checkpoint and ranks on separate disks (or given separate directories) one each."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    comm = engine.comm
    what = f"checkpoint save to {final} on rank {comm.rank}"
    nonce = _save_nonce(engine, what)
    if comm.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier(engine, what)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / f".present-{nonce}-{comm.rank:05d}").touch()
    _barrier(engine, what)
    sharing = sorted(int(p.name.rsplit("-", 1)[1]) for p in tmp.glob(f".present-{nonce}-*"))
    owner = sharing[0] == comm.rank  # the lowest rank that sees this directory finishes it
    if owner and comm.rank != 0:  # a directory rank 0 does not see: clear what an earlier save left
        for stale in tmp.iterdir():
            if not stale.name.startswith(f".present-{nonce}-"):
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    _barrier(engine, what)

    model = _model_tensors(engine.model) if owner else None  # copies
    tensors, meta = engine.state_dict()
    rank_path = tmp / rank_file(comm.rank, comm.world_size)
    encoded, buddies = None, {}
    if comm.world_size > 1:
        try:
            owners = peers.directory_owners(sharing[0], engine.device)
            if len(set(owners)) > 1:  # directories per node: keep the next node's files too
                encoded = _encode(tensors, {"engine": json.dumps(meta)})  # the file's bytes: a copy
                buddies = peers.exchange_buddy_copies(owners, comm.rank, encoded, engine.device)
        except Exception as exc:
            raise engine.watchdog.diagnose(what) from exc
    if background and encoded is None:  # the state's CPU tensors are the live ones: the thread writes a copy
        tensors = {k: v.clone() for k, v in tensors.items()}
    info = None
    if owner:
        info = {"format": FORMAT, "world_size": comm.world_size, "step": engine.step,
                "config": engine.cfg.to_dict(), "loss_fn": _saved_loss_name(engine.loss_fn),
                CHECKSUMS: CHECKSUM_ALGO}

    def write() -> None:
        if model is not None:
            _write(model, tmp / "model.safetensors")
        if encoded is None:
            _write(tensors, rank_path, {"engine": json.dumps(meta)})
        else:
            _write_bytes(encoded, rank_path)
        for src, data in buddies.items():
            _write_bytes(data, tmp / rank_file(src, comm.world_size))

    pending = _Pending(engine, final, tmp, owner, sharing + sorted(buddies), info, then)
    if background:
        pending.start(write)
        return pending
    write()
    return pending.finish(), owner


def finish_pending(engine) -> None:
    """Finish the periodic save still being written in the background, if any (every rank)."""
    pending = getattr(engine.loop, "pending_save", None)
    if pending is not None:
        engine.loop.pending_save = None
        pending.finish()


def _save_nonce(engine, what: str) -> str:
    """A name for this save that every rank shares (rank 0's), so a marker left by an earlier
    save is never taken for a peer of this one."""
    nonce = [os.urandom(8).hex() if engine.comm.rank == 0 else None]
    if engine.comm.world_size > 1:
        try:
            torch.distributed.broadcast_object_list(nonce, src=0)
        except Exception as exc:
            raise engine.watchdog.diagnose(what) from exc
    return nonce[0]


class Cadence:
    """When the next time-based checkpoint (``checkpoint_every_s``) is due, as a step every rank
    agrees on: the first after the first committed step; at each save the ranks take rank 0's
    seconds per step since the last save (one small all-reduce at the save, where no round is in
    flight) and the next is due that many seconds later, in steps. No collective between saves."""

    def __init__(self, step: int) -> None:
        self.next_step = step + 1
        self.mark = (time.perf_counter(), step)  # rank 0's (clock, step) at the last save

    def after_save(self, engine) -> None:
        now, (then, step0) = time.perf_counter(), self.mark
        per_step = (now - then) / max(1, engine.step - step0) if engine.rank == 0 else 0.0
        agreed = torch.tensor([per_step], dtype=torch.float64, device=engine.device)
        if engine.world_size > 1:
            try:
                engine.comm.all_reduce_sum(agreed)
            except Exception as exc:
                raise engine.watchdog.diagnose("agreeing on the checkpoint cadence") from exc
        per_step = float(agreed[0])
        interval = max(1, int(engine.cfg.checkpoint_every_s / per_step)) if per_step > 0 else 1
        self.next_step = engine.step + interval
        self.mark = (time.perf_counter(), engine.step)  # the save's own time is not a step's


def periodic_due(engine) -> bool:
    """Whether the step just committed is due a periodic checkpoint: every ``checkpoint_every``
    steps, or once the agreed step of the time-based cadence (``checkpoint_every_s``) is reached."""
    cfg = engine.cfg
    by_steps = bool(cfg.checkpoint_every) and engine.step % cfg.checkpoint_every == 0
    return by_steps or (cfg.checkpoint_every_s is not None and engine.step >= engine.loop.cadence.next_step)


def save_periodic(engine, root: str) -> str:
    """Checkpoint ``root/step-NNNNNNNN`` and point ``root/latest`` at it. With
    ``checkpoint_async`` the files are written on a thread from a copy of the state, and the
    checkpoint is finished (renamed, ``latest`` moved) at the next save or at close."""
    name = f"step-{engine.step:08d}"
    finish_pending(engine)

    def point_latest() -> None:
        pointer = Path(root) / (LATEST + ".tmp")
        pointer.write_text(name + "\n")
        os.replace(pointer, Path(root) / LATEST)

    path = str(Path(root) / name)
    if engine.cfg.checkpoint_async:
        engine.loop.pending_save = _save(engine, Path(root) / name, background=True, then=point_latest)
    else:
        _save(engine, Path(root) / name, then=point_latest)
    if engine.cfg.checkpoint_every_s is not None:
        engine.loop.cadence.after_save(engine)
    return path


def resolve(directory: str | os.PathLike) -> Path:
    """A checkpoint dir, or a root holding ``latest`` -> the checkpoint dir."""
    path = Path(directory)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if path.name.endswith(".tmp"):  # a save in progress, or one a lost peer left unfinished
        raise FileNotFoundError(f"{path} is an unfinished checkpoint (a save in progress or one that "
                                "failed): give the checkpoint root or a finished checkpoint directory")
    if not (path / "engine.json").is_file():
        raise FileNotFoundError(f"no complete checkpoint in {path} (engine.json is missing): "
                                "give a directory written by Engine.save or a checkpoint root")
    return path


def load(cls, directory, model, cfg: EngineConfig | None, loss_fn, max_steps: int | None = None):
    """Every rank of the run calls it. With several ranks, the ranks agree on the checkpoint and a
    rank gets the files its disk lacks from live peers (engine/checkpoint_peers.py)."""
    device, rank, world = start_process_group(trainable_parameters(model), cfg or EngineConfig())
    if world == 1:
        return _load(cls, resolve(directory), model, cfg, loss_fn, max_steps)
    path, scratch = peers.gather_checkpoint(directory, rank, world, device, _lost_peer)
    try:
        return _load(cls, resolve(path), model, cfg, loss_fn, max_steps)
    finally:
        peers.remove_scratch(scratch)


def _lost_peer(what: str) -> RuntimeError:
    return RuntimeError(f"{what} failed: a peer was lost or stalled before the engine started (its own "
                        "error says why); restart the run")


def _load(cls, path: Path, model, cfg: EngineConfig | None, loss_fn, max_steps: int | None):
    try:
        info = json.loads((path / "engine.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path / 'engine.json'} is corrupt ({exc}): use an earlier checkpoint") from exc
    if info.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {info.get('format')} is not {FORMAT}: written by another version")
    saved_cfg = EngineConfig.from_dict(info["config"])
    if cfg is None:
        cfg = saved_cfg
    else:
        diff = [f for f in STRUCTURAL_FIELDS if getattr(cfg, f) != getattr(saved_cfg, f)]
        if diff:
            raise ValueError("the checkpoint was written with a different configuration: " + ", ".join(
                f"{f}={getattr(saved_cfg, f)!r} there, {getattr(cfg, f)!r} here" for f in diff)
                + ": resume with the checkpoint's values or start a new run")
    if max_steps is not None:  # overrides cfg.max_steps, whichever cfg is used
        step = info["step"]
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= step:
            raise ValueError(f"max_steps={max_steps!r}, but the checkpoint in {path} is at step {step}: "
                             f"pass the total to train to, an integer above {step} (e.g. "
                             f"max_steps={step + 1000} for 1000 more steps)")
        cfg = EngineConfig.from_dict({**cfg.to_dict(), "max_steps": max_steps})
    _check_loss(path, info.get("loss_fn", _UNRECORDED), loss_fn)
    checked = info.get(CHECKSUMS)
    if checked is None:
        log.warning("the checkpoint in %s was written before checkpoints carried checksums: its data "
                    "cannot be verified", path)
    elif checked != CHECKSUM_ALGO:
        raise ValueError(f"the checkpoint in {path} has {checked!r} checksums and this version reads "
                         f"{CHECKSUM_ALGO!r}: it was written by another version")
    _load_model(model, path / "model.safetensors", required=checked is not None)
    engine = cls(model, cfg, loss_fn)
    error: Exception | None = None
    try:
        if engine.world_size != info["world_size"]:
            _restore_resized(engine, path, info["world_size"], required=checked is not None)
        else:
            _restore_rank_state(engine, path / rank_file(engine.rank, engine.world_size), required=checked is not None)
    except Exception as exc:  # any rank's failure stops every rank here, not in its first round
        error = exc
    _agree_loaded(engine, path, error)
    return engine


# ---------------------------------------------------------------------------- internals
def _barrier(engine, what: str) -> None:
    """A barrier whose failure names the lost peer, as a failed round does."""
    try:
        engine.comm.barrier()
    except Exception as exc:  # gloo/NCCL say only "connection reset" or time out
        raise engine.watchdog.diagnose(what) from exc


def _agree_loaded(engine, path: Path, error: Exception | None) -> None:
    """Every rank learns whether every rank restored its part, so none trains on alone."""
    failed = [engine.rank] if error is not None else []
    if engine.world_size > 1:
        flags = torch.zeros(engine.world_size, dtype=torch.int32, device=engine.device)
        flags[engine.rank] = int(error is not None)
        try:
            engine.comm.all_reduce_sum(flags)
        except Exception as exc:
            engine.close()
            raise engine.watchdog.diagnose(f"checkpoint load from {path} on rank {engine.rank}") from exc
        failed = [r for r, bad in enumerate(flags.tolist()) if bad]
    if not failed:
        return
    engine.close()
    if error is not None:
        raise error
    raise ValueError(f"rank(s) {failed} could not load their part of the checkpoint in {path} (their "
                     "error says why): use an earlier checkpoint")


def _loss_name(fn) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({_loss_name(fn.func)})"
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:  # a callable object: its class names it
        return f"{type(fn).__module__}.{type(fn).__qualname__}"
    return f"{getattr(fn, '__module__', None) or '?'}.{qualname}"


def _saved_loss_name(fn) -> str | None:
    name = _loss_name(fn)
    return None if name == DEFAULT_LOSS else name


def _check_loss(path: Path, saved, loss_fn) -> None:
    """A custom loss is not in the checkpoint: resuming without it would silently change the run."""
    if saved is _UNRECORDED:
        return
    if loss_fn is None:
        if saved is not None:
            raise ValueError(f"the checkpoint in {path} was trained with loss_fn {saved!r}; pass loss_fn=... "
                             "to Engine.load (the default, model(**batch).loss, is used only when it was "
                             "the default)")
        return
    given = _loss_name(loss_fn)
    if given != (saved or DEFAULT_LOSS):
        # names legitimately differ (a renamed function, a closure rebuilt by the script)
        log.warning("the checkpoint in %s was trained with loss_fn %r and this run uses %r: make sure it "
                    "computes the same loss", path, saved or f"{DEFAULT_LOSS} (the default)", given)


def _digest(data) -> str:
    """blake2b-128 of a CPU tensor's raw bytes (or of a str): ~1 GB/s, no copy of contiguous data."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(data, str):
        h.update(data.encode())
    else:
        h.update(data.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _checked_metadata(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = dict(metadata or {})
    sums = {"algo": CHECKSUM_ALGO, "tensors": {k: _digest(v) for k, v in tensors.items()},
            "metadata": {k: _digest(v) for k, v in metadata.items()}}
    return {**metadata, CHECKSUMS: json.dumps(sums)}


def _write(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None) -> None:
    save_file(tensors, str(file), metadata=_checked_metadata(tensors, metadata))


def _encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The bytes ``_write`` would put in a file (a rank file sent to its buddy)."""
    return save_bytes(tensors, metadata=_checked_metadata(tensors, metadata))


def _write_bytes(data: bytes, file: Path) -> None:
    with open(file, "wb") as f:
        f.write(data)


def _read(file: Path, required: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file, verified against its checksums.

    ``required``: the checkpoint was written with checksums, so a file without them is corrupt."""
    try:
        with safe_open(str(file), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{file} is corrupt or unreadable ({exc}): use an earlier checkpoint") from exc
    raw = metadata.get(CHECKSUMS)
    if raw is None:
        if required:
            raise ValueError(f"{file} has no checksums though its checkpoint was written with them (the "
                             "file is corrupt or was replaced): use an earlier checkpoint")
        return tensors, metadata
    try:
        sums = json.loads(raw)
        algo, tensor_sums, meta_sums = sums["algo"], dict(sums["tensors"]), dict(sums["metadata"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{file}: its checksum table is corrupt ({exc}): use an earlier checkpoint") from exc
    if algo != CHECKSUM_ALGO:
        raise ValueError(f"{file} has {algo!r} checksums and this version reads {CHECKSUM_ALGO!r}: it was "
                         "written by another version")
    if set(tensor_sums) != set(tensors):
        raise ValueError(f"{file} holds tensors {sorted(set(tensors) - set(tensor_sums))[:5]} it has no "
                         f"checksum for and lacks {sorted(set(tensor_sums) - set(tensors))[:5]} (the file is "
                         "corrupt): use an earlier checkpoint")
    for name, t in tensors.items():
        if _digest(t) != tensor_sums[name]:
            raise ValueError(f"{file}: tensor {name!r} fails its checksum (the file is corrupt): use an "
                             "earlier checkpoint")
    for key, digest in meta_sums.items():
        if key not in metadata or _digest(metadata[key]) != digest:
            raise ValueError(f"{file}: metadata {key!r} fails its checksum (the file is corrupt): use an "
                             "earlier checkpoint")
    return tensors, metadata


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the model's tensors (tied weights once)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple]] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:  # tied weights are saved once
            continue
        seen.add(key)
        tensors[name] = t.detach().to("cpu").clone().contiguous()
    return tensors


def _load_model(model: torch.nn.Module, file: Path, required: bool) -> None:
    tensors, _ = _read(file, required)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    own = model.state_dict()
    # keys missing from the file are allowed only for tied weights saved under another name
    real_missing = [k for k in missing if not any(own[k].data_ptr() == own[o].data_ptr() for o in tensors if o in own)]
    if real_missing or unexpected:
        raise ValueError(f"{file} does not match this model (missing {real_missing[:5]}, unexpected "
                         f"{unexpected[:5]}): load it into the model it was saved from")


def _read_rank_state(file: Path, required: bool) -> tuple[dict[str, torch.Tensor], dict]:
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: the checkpoint is incomplete, use an earlier one")
    tensors, metadata = _read(file, required)
    try:
        meta = json.loads(metadata["engine"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is corrupt or unreadable (engine metadata: {exc}): use an earlier checkpoint") from exc
    return tensors, meta


def _restore_rank_state(engine, file: Path, required: bool) -> None:
    tensors, meta = _read_rank_state(file, required)
    engine.load_state_dict(tensors, meta, where=str(file))


def _restore_resized(engine, path: Path, saved_world: int, required: bool) -> None:
    """A checkpoint of ``saved_world`` workers at this run's world size: every rank reads every
    rank file and re-cuts the state for its new shard (engine/reshard.py says by which rules)."""
    info = json.loads((path / "engine.json").read_text())
    absent = [r for r in range(saved_world) if not (path / rank_file(r, saved_world)).is_file()]
    if absent and "ranks_here" in info:
        raise ValueError(f"the checkpoint in {path} is node-local: it holds the files of ranks {info['ranks_here']} "
                         f"of {saved_world}, and re-cutting for {engine.world_size} workers needs all of them. Resume "
                         "with the ranks of the other nodes running (they send their files), or copy every "
                         "node's rank files into one directory")
    old = [_read_rank_state(path / rank_file(r, saved_world), required) for r in range(saved_world)]
    tensors, meta, report = reshard.recut(engine, old, f"the checkpoint in {path}")
    engine.load_state_dict(tensors, meta, where=f"{path} (re-cut from {saved_world} to {engine.world_size} workers)")
    if engine.rank == 0:
        carried = ", ".join(f"{k}: {v}" for k, v in report["carried"].items())
        log.warning("resized at step %d: the checkpoint in %s was written by %d workers, this run has %d; "
                    "carried %s; dropped %s", meta["step"], path, saved_world, engine.world_size, carried,
                    "; ".join(report["dropped"]) or "nothing")
