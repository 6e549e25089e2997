"""Every rank trains the same thing: at start, ranks compare what decides the trajectory (the
trainable parameters' names, shapes, dtypes and requires_grad, and every setting that shapes the
computation or the collectives) and all raise together when one differs.

Without this, ranks that built different models (another config file or layer count on one
node) reach the first collective with buffers of different sizes: gloo aborts the process
(``gloo::EnforceNotMet ... Received data size doesn't match expected size``) and the other
ranks wait out the timeout. One all-gather of a 32-byte digest costs nothing when all agree;
only on a mismatch do the ranks exchange their descriptions to name the first difference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
import torch.distributed as dist

# settings that do not change what a step computes or which collectives run
LOCAL_SETTINGS = frozenset({"timeout_s", "heartbeat_s", "checkpoint_dir", "checkpoint_every", "progress",
                            "record_timeline", "poison_freed_buffers", "keep_cpu_memory"})


def describe(model: torch.nn.Module, cfg) -> list[tuple[str, str]]:
    """(what, value) pairs every rank must share: the parameters, then the settings."""
    out = [(f"parameter {name!r}", f"shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}")
           for name, p in model.named_parameters()]
    for name in cfg.field_names():
        if name not in LOCAL_SETTINGS:
            value = getattr(cfg, name)
            out.append((f"setting {name}", repr(dataclasses.asdict(value) if dataclasses.is_dataclass(value)
                                                else value)))
    return out


def _digest(entries: list[tuple[str, str]], device: torch.device) -> torch.Tensor:
    raw = hashlib.sha256(json.dumps(entries).encode()).digest()
    return torch.frombuffer(bytearray(raw), dtype=torch.int64).to(device)


def first_difference(reference: list[tuple[str, str]], other: list[tuple[str, str]]) -> tuple[str, str, str]:
    """(what, value in reference, value in other) of the first entry that differs ("absent"
    where one side has no such entry), in the reference's order."""
    theirs, ours = dict(other), dict(reference)
    for what, value in reference:
        if theirs.get(what, "absent") != value:
            return what, value, theirs.get(what, "absent")
    what = next(w for w, _ in other if w not in ours)
    return what, "absent", theirs[what]


def check_same_training(model: torch.nn.Module, cfg, rank: int, world: int, device: torch.device) -> None:
    """Raise ValueError on every rank, naming the first rank and the first parameter or setting
    that differs from rank 0's, unless all ranks describe the same training."""
    if world == 1:
        return
    entries = describe(model, cfg)
    mine = _digest(entries, device)
    seen = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(seen, mine)
    if all(torch.equal(s, seen[0]) for s in seen):
        return
    every: list = [None] * world
    dist.all_gather_object(every, entries)
    bad = next(r for r in range(world) if not torch.equal(seen[r], seen[0]))
    what, ours, theirs = first_difference([tuple(e) for e in every[0]], [tuple(e) for e in every[bad]])
    raise ValueError(
        f"rank {bad} does not train what rank 0 trains: {what} is {theirs} on rank {bad} and {ours} on rank 0. "
        "Every rank must build the same model (same architecture, trainable parameters and dtype) and the "
        "same EngineConfig: launch every node with the same script, config and seed")
