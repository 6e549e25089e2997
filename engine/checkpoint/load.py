"""Loading a checkpoint (engine/checkpoint/writer.py describes its files): the directory every rank
agrees on, its engine.json and config checked against this run's, the model loaded, then each
rank's state read (or re-cut for another world size, engine/checkpoint/reshard.py), and every rank told
whether every rank restored its part. ``Engine.load`` puts these steps together."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import STRUCTURAL_FIELDS, EngineConfig
from ..core.context import start_process_group, trainable_parameters
from ..core.loading import default_device, on_meta
from ..core.loss import default_loss
from ..parallel.dims import load_group
from . import peers as peers
from .files import CHECKSUM_ALGO, CHECKSUMS, load_model, read_rank_state
from .peers import LATEST, rank_file

log = logging.getLogger("acco_loco")

FORMAT = 1  # checksums and loss_fn are optional additions: format-1 readers ignore them
DEFAULT_LOSS = f"{default_loss.__module__}.{default_loss.__qualname__}"  # recorded as null
_UNRECORDED = object()  # engine.json of a checkpoint written before loss_fn was recorded

# (the old ranks' (tensors, meta), where) -> (tensors, meta, report) for this rank: reshard.recut
Recut = Callable[[list, str], tuple[dict, dict, dict]]


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


@dataclass
class OpenCheckpoint:
    """A checkpoint every rank agreed on, its model loaded: what the engine is built from."""

    path: Path
    info: dict  # engine.json
    cfg: EngineConfig  # the run's configuration (the checkpoint's, or the caller's, checked)
    scratch: Path | None  # files received from peers (engine/checkpoint/peers.py), removed by close()
    weights: Path | None = None  # a model built on the meta device: each rank reads its values here at start

    @property
    def checked(self) -> bool:
        """Written with checksums: a file without them is corrupt."""
        return self.info.get(CHECKSUMS) is not None

    def rank_state(self, rank: int, world: int, recut: Recut) -> tuple[dict[str, torch.Tensor], dict, str]:
        """(tensors, meta, where) of this rank: its own rank file, or at another world size every
        rank file re-cut by ``recut``."""
        saved_world = self.info["world_size"]
        if world == saved_world:
            file = self.path / rank_file(rank, world)
            return (*read_rank_state(file, self.checked), str(file))
        path = self.path
        absent = [r for r in range(saved_world) if not (path / rank_file(r, saved_world)).is_file()]
        if absent and "ranks_here" in self.info:
            raise ValueError(f"the checkpoint in {path} is node-local: it holds the files of ranks "
                             f"{self.info['ranks_here']} of {saved_world}, and re-cutting for {world} workers "
                             "needs all of them. Resume with the ranks of the other nodes running (they send "
                             "their files), or copy every node's rank files into one directory")
        old = [read_rank_state(path / rank_file(r, saved_world), self.checked) for r in range(saved_world)]
        tensors, meta, report = recut(old, f"the checkpoint in {path}")
        if rank == 0:
            carried = ", ".join(f"{k}: {v}" for k, v in report["carried"].items())
            log.warning("resized at step %d: the checkpoint in %s was written by %d workers, this run has %d; "
                        "carried %s; dropped %s", meta["step"], path, saved_world, world, carried,
                        "; ".join(report["dropped"]) or "nothing")
        return tensors, meta, f"{path} (re-cut from {saved_world} to {world} workers)"

    def close(self) -> None:
        peers.remove_scratch(self.scratch)


def open_checkpoint(directory, model: torch.nn.Module, cfg: EngineConfig | None, loss_fn,
                    max_steps: int | None = None) -> OpenCheckpoint:
    """Every rank of the run calls it. With several ranks, the ranks agree on the checkpoint and a
    rank gets the files its disk lacks from live peers (engine/checkpoint/peers.py)."""
    meta = on_meta(model)  # its values are read at engine start, each rank its own (engine/core/loading.py)
    device, rank, world = start_process_group(trainable_parameters(model), cfg or EngineConfig(),
                                              default_device() if meta else None)
    if world == 1:
        path, scratch = directory, None
    else:
        group = load_group(world, device, (cfg or EngineConfig()).timeout_s)
        try:
            path, scratch = peers.gather_checkpoint(directory, rank, world, device, _lost_peer, group)
        finally:
            dist.destroy_process_group(group)
    try:
        path = resolve(path)
        info, cfg = _read_info(path, cfg, loss_fn, max_steps)
        if not meta:
            load_model(model, path / "model.safetensors", required=info.get(CHECKSUMS) is not None)
        elif rank == 0 and info.get(CHECKSUMS) is not None:
            log.warning("the model is on the meta device: each rank reads only its rows of %s, so that file's "
                        "per-tensor checksums are not checked (the rank files' are)", path / "model.safetensors")
    except BaseException:
        peers.remove_scratch(scratch)
        raise
    return OpenCheckpoint(path, info, cfg, scratch, path if meta else None)


def _lost_peer(what: str) -> RuntimeError:
    return RuntimeError(f"{what} failed: a peer was lost or stalled before the engine started (its own "
                        "error says why); restart the run")


def _auto_choice(cfg: EngineConfig, saved: EngineConfig) -> dict:
    """The saved strategy, and its codecs where ``cfg`` left them to auto (codec "none",
    param_codec "auto"); a codec ``cfg`` set stays and is checked against the saved one."""
    free = {"codec": "none", "param_codec": "auto"}
    return {"strategy": saved.strategy, **{k: getattr(saved, k) for k, v in free.items() if getattr(cfg, k) == v}}


def _read_info(path: Path, cfg: EngineConfig | None, loss_fn, max_steps: int | None) -> tuple[dict, EngineConfig]:
    """engine.json, and the configuration to build the engine with (checked against it)."""
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
        if cfg.strategy == "auto":  # keep what auto chose when the run began (no new probe)
            cfg = EngineConfig.from_dict({**cfg.to_dict(), **_auto_choice(cfg, saved_cfg)})
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
    return info, cfg


def agree_loaded(comm, device: torch.device, watchdog, path: Path, error: Exception | None,
                 close: Callable[[], None]) -> None:
    """Every rank learns whether every rank restored its part, so none trains on alone; on a
    failure anywhere ``close`` (the engine's) runs and the error is raised."""
    rank, world = comm.rank, comm.world_size
    failed = [rank] if error is not None else []
    if world > 1:
        flags = torch.zeros(world, dtype=torch.int32, device=device)
        flags[rank] = int(error is not None)
        try:
            comm.all_reduce_sum(flags)
        except Exception as exc:
            close()
            raise watchdog.diagnose(f"checkpoint load from {path} on rank {rank}") from exc
        failed = [r for r, bad in enumerate(flags.tolist()) if bad]
    if not failed:
        return
    close()
    if error is not None:
        raise error
    raise ValueError(f"rank(s) {failed} could not load their part of the checkpoint in {path} (their "
                     "error says why): use an earlier checkpoint")


def loss_name(fn) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({loss_name(fn.func)})"
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:  # a callable object: its class names it
        return f"{type(fn).__module__}.{type(fn).__qualname__}"
    return f"{getattr(fn, '__module__', None) or '?'}.{qualname}"


def saved_loss_name(fn) -> str | None:
    """What engine.json records for the loss function (null: the default)."""
    name = loss_name(fn)
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
    given = loss_name(loss_fn)
    if given != (saved or DEFAULT_LOSS):
        # names legitimately differ (a renamed function, a closure rebuilt by the script)
        log.warning("the checkpoint in %s was trained with loss_fn %r and this run uses %r: make sure it "
                    "computes the same loss", path, saved or f"{DEFAULT_LOSS} (the default)", given)
