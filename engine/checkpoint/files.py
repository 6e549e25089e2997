"""The files of a checkpoint: safetensors with a checksum of each tensor and of the metadata.

Every safetensors file carries a checksum of each tensor and of its metadata (metadata key
``checksums``); reading verifies them, so a flipped bit is an error that names the file and the
tensor instead of a run that trains on garbage. ``required=False`` reads a file of a checkpoint
written before checksums existed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_bytes
from safetensors.torch import save_file

CHECKSUMS = "checksums"  # safetensors metadata key (and engine.json field: the algorithm)
CHECKSUM_ALGO = "blake2b-128"


def digest(data) -> str:
    """blake2b-128 of a CPU tensor's raw bytes (or of a str): ~1 GB/s, no copy of contiguous data."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(data, str):
        h.update(data.encode())
    else:
        h.update(data.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _checked_metadata(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = dict(metadata or {})
    sums = {"algo": CHECKSUM_ALGO, "tensors": {k: digest(v) for k, v in tensors.items()},
            "metadata": {k: digest(v) for k, v in metadata.items()}}
    return {**metadata, CHECKSUMS: json.dumps(sums)}


def write(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None) -> None:
    save_file(tensors, str(file), metadata=_checked_metadata(tensors, metadata))


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The bytes ``write`` would put in a file (a rank file sent to its buddy)."""
    return save_bytes(tensors, metadata=_checked_metadata(tensors, metadata))


def write_bytes(data: bytes, file: Path) -> None:
    with open(file, "wb") as f:
        f.write(data)


def read(file: Path, required: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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
        if digest(t) != tensor_sums[name]:
            raise ValueError(f"{file}: tensor {name!r} fails its checksum (the file is corrupt): use an "
                             "earlier checkpoint")
    for key, want in meta_sums.items():
        if key not in metadata or digest(metadata[key]) != want:
            raise ValueError(f"{file}: metadata {key!r} fails its checksum (the file is corrupt): use an "
                             "earlier checkpoint")
    return tensors, metadata


def model_tensors(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """CPU copies of the model's tensors (tied weights once), or None where not ``keep``. An FSDP2
    model's sharded tensors are gathered whole one at a time, which every rank of the node joins."""
    from torch.distributed.tensor import DTensor

    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple]] = set()
    for name, t in model.state_dict().items():
        sharded = isinstance(t, DTensor)
        key = ((t.to_local() if sharded else t).data_ptr(), tuple(t.shape))
        if key in seen:  # tied weights are saved once
            continue
        seen.add(key)
        whole = t.full_tensor() if sharded else t
        if keep:
            tensors[name] = whole.detach().to("cpu").clone().contiguous()
    return tensors if keep else None


def load_model(model: torch.nn.Module, file: Path, required: bool) -> None:
    tensors, _ = read(file, required)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    own = model.state_dict()
    # keys missing from the file are allowed only for tied weights saved under another name
    real_missing = [k for k in missing if not any(own[k].data_ptr() == own[o].data_ptr() for o in tensors if o in own)]
    if real_missing or unexpected:
        raise ValueError(f"{file} does not match this model (missing {real_missing[:5]}, unexpected "
                         f"{unexpected[:5]}): load it into the model it was saved from")


def read_rank_state(file: Path, required: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """A rank file's tensors and its engine metadata (counters, sizes, the strategy's)."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: the checkpoint is incomplete, use an earlier one")
    tensors, metadata = read(file, required)
    try:
        meta = json.loads(metadata["engine"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is corrupt or unreadable (engine metadata: {exc}): use an earlier checkpoint") from exc
    return tensors, meta
