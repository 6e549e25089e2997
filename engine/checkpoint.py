"""Checkpoints in safetensors: the model once, and one file per rank for its shard and state.

Layout of a checkpoint directory:
    model.safetensors           the compute parameters every replica holds (rank 0 writes it)
    rank00001-of-00003.safetensors
                                that rank's fp32 master shard, optimizer moments, the gradient it
                                accumulated but has not sent yet, the reduced estimate half it
                                keeps (acco), its RNG state; engine counters in the metadata
    engine.json                 world size, step, config; written last

Every rank writes into ``<dir>.tmp``; after a barrier rank 0 renames it to ``<dir>``, so a
checkpoint is either complete or absent. Multi-node runs need a shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from acco_loco.acco import KeptHalf

from .config import STRUCTURAL_FIELDS, EngineConfig

FORMAT = 1
LATEST = "latest"


def rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


def save(engine, directory: str | os.PathLike) -> str:
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    comm = engine.comm
    if comm.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    comm.barrier()

    if comm.rank == 0:
        _save_model(engine.model, tmp / "model.safetensors")
    tensors, meta = _rank_state(engine)
    save_file(tensors, str(tmp / rank_file(comm.rank, comm.world_size)), metadata={"engine": json.dumps(meta)})
    comm.barrier()

    if comm.rank == 0:
        info = {"format": FORMAT, "world_size": comm.world_size, "step": engine.step,
                "config": engine.cfg.to_dict()}
        with open(tmp / "engine.json", "w") as f:
            json.dump(info, f, indent=1)
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
    comm.barrier()
    return str(final)


def save_periodic(engine, root: str) -> str:
    """Checkpoint ``root/step-NNNNNNNN`` and point ``root/latest`` at it."""
    name = f"step-{engine.step:08d}"
    path = save(engine, Path(root) / name)
    if engine.comm.rank == 0:
        pointer = Path(root) / (LATEST + ".tmp")
        pointer.write_text(name + "\n")
        os.replace(pointer, Path(root) / LATEST)
    engine.comm.barrier()
    return path


def resolve(directory: str | os.PathLike) -> Path:
    """A checkpoint dir, or a root holding ``latest`` -> the checkpoint dir."""
    path = Path(directory)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if not (path / "engine.json").is_file():
        raise FileNotFoundError(f"no complete checkpoint in {path} (engine.json is missing): "
                                "give a directory written by Engine.save or a checkpoint root")
    return path


def load(cls, directory, model, cfg: EngineConfig | None, loss_fn, max_steps: int | None = None):
    path = resolve(directory)
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
    if max_steps is not None:
        cfg = EngineConfig.from_dict({**cfg.to_dict(), "max_steps": max_steps})
    _load_model(model, path / "model.safetensors")
    engine = cls(model, cfg, loss_fn)
    if engine.world_size != info["world_size"]:
        raise ValueError(f"the checkpoint in {path} was written by {info['world_size']} workers and this "
                         f"run has {engine.world_size}: resume with {info['world_size']} workers")
    _restore_rank_state(engine, path / rank_file(engine.rank, engine.world_size))
    return engine


# ---------------------------------------------------------------------------- internals
def _save_model(model: torch.nn.Module, file: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple]] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:  # tied weights are saved once
            continue
        seen.add(key)
        tensors[name] = t.detach().to("cpu").clone().contiguous()
    save_file(tensors, str(file))


def _load_model(model: torch.nn.Module, file: Path) -> None:
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file} is corrupt or unreadable ({exc}): use an earlier checkpoint") from exc
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    own = model.state_dict()
    # keys missing from the file are allowed only for tied weights saved under another name
    real_missing = [k for k in missing if not any(own[k].data_ptr() == own[o].data_ptr() for o in tensors if o in own)]
    if real_missing or unexpected:
        raise ValueError(f"{file} does not match this model (missing {real_missing[:5]}, unexpected "
                         f"{unexpected[:5]}): load it into the model it was saved from")


def _rank_state(engine) -> tuple[dict[str, torch.Tensor], dict]:
    state = engine.shard_state
    tensors = {f"opt.{k}": v.detach().cpu().contiguous() for k, v in state.tensors().items()}
    tensors["pending_grad"] = engine.flat.grads[engine.flat.active].detach().cpu().contiguous()
    tensors["rng_cpu"] = torch.get_rng_state()
    if engine.device.type == "cuda":
        tensors["rng_cuda"] = torch.cuda.get_rng_state(engine.device)
    if engine.grad_codec is not None:
        for k, v in engine.grad_codec.feedback.state_dict().items():
            tensors[f"feedback.{k}"] = v.detach().cpu().contiguous()
    kept = engine._kept
    if kept is not None:
        tensors["kept_grad_sum"] = kept.grad_sum.detach().cpu().contiguous()
    meta = {
        "rank": engine.rank, "world_size": engine.world_size, "step": engine.step,
        "opt_step": state.step, "round_index": engine.round_index, "consumed": engine.consumed,
        "pending_count": engine._count, "pending_samples": engine._samples,
        "pending_loss": float(engine._loss_sum), "shard_size": engine.flat.shard_size,
        "numel": engine.flat.numel,
        "kept": None if kept is None else {"count": kept.count, "loss_sum": kept.loss_sum, "samples": kept.samples},
    }
    return tensors, meta


def _restore_rank_state(engine, file: Path) -> None:
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: the checkpoint is incomplete, use an earlier one")
    try:
        with safe_open(str(file), "pt") as f:
            meta = json.loads(f.metadata()["engine"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is corrupt or unreadable ({exc}): use an earlier checkpoint") from exc
    flat = engine.flat
    if meta["shard_size"] != flat.shard_size or meta["numel"] != flat.numel:
        raise ValueError(f"{file} holds a shard of {meta['shard_size']} values for a model of "
                         f"{meta['numel']} trainable values; this engine has {flat.shard_size} and "
                         f"{flat.numel}: same model, same trainable parameters and align are needed")
    dev = engine.device
    state = engine.shard_state
    state.master.copy_(tensors["opt.master"].to(dev))
    state.exp_avg.copy_(tensors["opt.exp_avg"].to(dev))
    if state.exp_avg_sq is not None:
        state.exp_avg_sq.copy_(tensors["opt.exp_avg_sq"].to(dev))
    state.step = meta["opt_step"]
    with torch.no_grad():
        flat.grads[flat.active].copy_(tensors["pending_grad"].to(dev))
        engine.gather_buf.copy_(flat.data)
    if engine.grad_codec is not None:
        fb = {k[len("feedback."):]: v.to(dev) for k, v in tensors.items() if k.startswith("feedback.")}
        if not fb:
            raise ValueError(f"{file} holds no error-feedback state but codec={engine.cfg.codec!r} needs it")
        engine.grad_codec.feedback.load_state_dict(fb)
    torch.set_rng_state(tensors["rng_cpu"])
    if "rng_cuda" in tensors and dev.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng_cuda"], dev)
    engine.step = meta["step"]
    engine.round_index = meta["round_index"]
    engine.consumed = meta["consumed"]
    engine._count = meta["pending_count"]
    engine._samples = meta["pending_samples"]
    engine._loss_sum = torch.tensor(meta["pending_loss"], dtype=torch.float32, device=dev)
    if meta["kept"] is not None:
        k = meta["kept"]
        engine._kept = KeptHalf(tensors["kept_grad_sum"].to(dev), k["count"], k["loss_sum"], k["samples"])
