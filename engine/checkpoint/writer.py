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
resumes from them at the same world size. A checkpoint of N workers loads at another world size:
every rank reads all N rank files and re-cuts them (engine/checkpoint/reshard.py). A peer lost during a save
is named (the watchdog's diagnosis), and ``<dir>.tmp`` is never loaded.

This file writes a checkpoint (``CheckpointWriter``); engine/checkpoint/files.py holds the
checksummed file format, engine/checkpoint/load.py the load, engine/checkpoint/periodic.py the
periodic saves, engine/checkpoint/peers.py the buddy copies and the files fetched from peers.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed

from . import peers as peers
from .files import CHECKSUM_ALGO, CHECKSUMS, encode, model_tensors, write, write_bytes
from .load import FORMAT, resolve, saved_loss_name
from .peers import LATEST, rank_file

__all__ = ["CheckpointWriter", "PendingSave", "LATEST", "rank_file", "resolve"]


class CheckpointWriter:
    """Writes checkpoints of this rank's training state. Its parts: ``comm`` (barriers, the
    buddy copies), ``device``, ``watchdog`` (names a peer lost during a save), the ``model``
    (model.safetensors), ``cfg`` and ``loss_fn`` (engine.json), ``state`` (this rank's
    (tensors, meta): ``Engine.state_dict``) and ``counters`` (EngineState: the step)."""

    def __init__(self, comm, device: torch.device, watchdog, model: torch.nn.Module, cfg, loss_fn,
                 state: Callable[[], tuple[dict[str, torch.Tensor], dict]], counters):
        self.comm, self.device, self.watchdog, self.model = comm, device, watchdog, model
        self.cfg, self.loss_fn, self.state, self.counters = cfg, loss_fn, state, counters

    @property
    def step(self) -> int:
        return self.counters.step

    def save(self, directory: str | os.PathLike, then: Callable[[], None] | None = None) -> str:
        """Write a checkpoint now (every rank); returns its directory. ``then`` runs on the rank
        that finishes the directory, after the rename (a periodic save moves ``latest``)."""
        pending, write_files = self._prepare(directory, background=False, then=then)
        write_files()
        return pending.finish()

    def start(self, directory: str | os.PathLike, then: Callable[[], None] | None = None) -> "PendingSave":
        """Write a checkpoint in the background from a copy of the state (every rank); the
        returned save is finished (``finish``) at a point with no round in flight."""
        pending, write_files = self._prepare(directory, background=True, then=then)
        pending.start(write_files)
        return pending

    def barrier(self, what: str) -> None:
        """A barrier whose failure names the lost peer, as a failed round does."""
        try:
            self.comm.barrier()
        except Exception as exc:  # gloo/NCCL say only "connection reset" or time out
            raise self.watchdog.diagnose(what) from exc

    def _prepare(self, directory, background: bool, then):
        """The pending save and the function that writes its files. The lowest rank that sees a
        directory writes its model and engine.json and renames it, so ranks with a shared
        filesystem write one checkpoint and ranks on separate disks (or given separate
        directories) one each."""
        final = Path(directory)
        tmp = final.with_name(final.name + ".tmp")
        comm = self.comm
        what = f"checkpoint save to {final} on rank {comm.rank}"
        nonce = self._nonce(what)
        if comm.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        self.barrier(what)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / f".present-{nonce}-{comm.rank:05d}").touch()
        self.barrier(what)
        sharing = sorted(int(p.name.rsplit("-", 1)[1]) for p in tmp.glob(f".present-{nonce}-*"))
        owner = sharing[0] == comm.rank  # the lowest rank that sees this directory finishes it
        if owner and comm.rank != 0:  # a directory rank 0 does not see: clear what an earlier save left
            for stale in tmp.iterdir():
                if not stale.name.startswith(f".present-{nonce}-"):
                    shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        self.barrier(what)

        model = model_tensors(self.model, owner)  # copies (an FSDP2 model's gathered in each node: every rank)
        tensors, meta = self.state()
        rank_path = tmp / rank_file(comm.rank, comm.world_size)
        encoded, buddies = None, {}
        if comm.world_size > 1:
            try:
                owners = peers.directory_owners(sharing[0], self.device, comm.group)
                if len(set(owners)) > 1:  # directories per node: keep the next node's files too
                    encoded = encode(tensors, {"engine": json.dumps(meta)})  # the file's bytes: a copy
                    buddies = peers.exchange_buddy_copies(owners, comm.rank, encoded, self.device, comm.group)
            except Exception as exc:
                raise self.watchdog.diagnose(what) from exc
        if background and encoded is None:  # the state's CPU tensors are the live ones: the thread writes a copy
            tensors = {k: v.clone() for k, v in tensors.items()}
        info = None
        if owner:
            info = {"format": FORMAT, "world_size": comm.world_size, "step": self.step,
                    "config": self.cfg.to_dict(), "loss_fn": saved_loss_name(self.loss_fn),
                    CHECKSUMS: CHECKSUM_ALGO}

        def write_files() -> None:
            if model is not None:
                write(model, tmp / "model.safetensors")
            if encoded is None:
                write(tensors, rank_path, {"engine": json.dumps(meta)})
            else:
                write_bytes(encoded, rank_path)
            for src, data in buddies.items():
                write_bytes(data, tmp / rank_file(src, comm.world_size))

        return PendingSave(self, final, tmp, owner, sharing + sorted(buddies), info, then), write_files

    def _nonce(self, what: str) -> str:
        """A name for this save that every rank shares (rank 0's), so a marker left by an earlier
        save is never taken for a peer of this one."""
        try:
            return self.comm.broadcast_object(os.urandom(8).hex() if self.comm.rank == 0 else None, src=0)
        except Exception as exc:
            raise self.watchdog.diagnose(what) from exc


class PendingSave:
    """A save whose files are written (``start`` on a thread, or by the caller), then finished on
    every rank: a barrier, the lowest rank that sees the directory writes engine.json and renames
    it, ``then`` (the owner: the ``latest`` pointer), a barrier. A background write runs from a
    copy of the state, and its finish waits for the next save or close (both are points with no
    round in flight, where the compute side may use the process group)."""

    def __init__(self, writer: CheckpointWriter, final: Path, tmp: Path, owner: bool, sharing: list[int],
                 info: dict | None, then=None):
        self.writer, self.final, self.tmp, self.owner, self.sharing = writer, final, tmp, owner, sharing
        self.info, self.then = info, then
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.write_s = 0.0

    def start(self, write_files) -> None:
        def run():
            t0 = time.perf_counter()
            try:
                write_files()
            except BaseException as exc:  # raised on the compute side when the save is finished
                self.error = exc
            self.write_s = time.perf_counter() - t0
        self.thread = threading.Thread(target=run, name="acco-loco-checkpoint", daemon=True)
        self.thread.start()

    def finish(self) -> str:
        final, tmp, comm = self.final, self.tmp, self.writer.comm
        what = f"checkpoint save to {final} on rank {comm.rank}"
        if self.thread is not None:
            self.thread.join()
            if self.error is not None:
                raise RuntimeError(f"writing the checkpoint {final} failed on rank {comm.rank}") from self.error
        self.writer.barrier(what)
        if self.owner:
            if len(self.sharing) < comm.world_size:  # node-local directories: these ranks' files
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
        self.writer.barrier(what)
        return str(final)
