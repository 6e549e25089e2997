"""Every rank trains the same thing: at engine start the ranks compare what they were given.

A rank built with another model (a layer more, another dtype) or another config (strategy, codec,
learning rate, global batch) would otherwise meet the others in the first collective with buffers
of another size: gloo aborts the process (``gloo::EnforceNotMet ... Received data size doesn't
match expected size``) and the peers wait, or, worse, the sizes happen to match and the ranks
train different things together. torch DDP checks the parameter shapes at construction; this
checks the parameter layout and every config field that shapes the optimization.

One small collective when the ranks agree: a 16-byte digest of the description, all-gathered.
Only on a mismatch a second exchange carries the descriptions, so that every rank raises the same
error naming the first rank that differs from rank 0 and the first field or parameter.
"""

from __future__ import annotations

import hashlib

import torch

from .comm import _all_gather_single

# per-rank settings that may differ between ranks: where this node writes, how long it waits,
# what it shows; everything else in EngineConfig shapes the training and must agree
PER_RANK_FIELDS = frozenset({"runtime.timeout_s", "runtime.heartbeat_s", "runtime.checkpoint_dir",
                             "runtime.progress", "runtime.record_timeline", "runtime.poison_freed_buffers",
                             "runtime.keep_cpu_memory"})


def describe(model: torch.nn.Module, cfg) -> dict[str, str]:
    """What must agree, in a fixed order: config fields, then every parameter (trainable or not)."""
    out: dict[str, str] = {}
    for section, value in cfg.to_dict().items():
        fields = value.items() if isinstance(value, dict) else [(None, value)]
        for name, v in fields:
            key = f"config.{section}" if name is None else f"config.{section}.{name}"
            if key.removeprefix("config.") not in PER_RANK_FIELDS:
                out[key] = repr(v)
    for name, p in model.named_parameters():
        out[f"parameter {name}"] = f"shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}"
    return out


def digest(description: dict[str, str]) -> torch.Tensor:
    h = hashlib.blake2b(digest_size=16)
    for k, v in description.items():
        h.update(f"{k}={v}\n".encode())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.int64).clone()


def first_difference(mine: dict[str, str], theirs: dict[str, str]) -> tuple[str, str, str]:
    """(key, rank 0's value, the other rank's value) of the first entry that differs."""
    for key in list(mine) + [k for k in theirs if k not in mine]:
        a, b = mine.get(key, "absent"), theirs.get(key, "absent")
        if a != b:
            return key, a, b
    return "the description's order", "-", "-"


def check_agreement(model: torch.nn.Module, cfg, control, device: torch.device) -> None:
    """Raise the same ValueError on every rank if any rank's model or config differs from rank 0's.

    Collective on ``control`` (the engine's world group of the compute thread): every rank calls
    it once, before the first collective that depends on the sizes."""
    world = control.world_size
    if world <= 1:
        return
    mine = describe(model, cfg)
    local = digest(mine).to(device)
    gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=device)
    _all_gather_single(gathered, local, group=control.group)  # start-up: not counted as a round's bytes
    rows = gathered.view(world, -1).cpu()
    differ = [r for r in range(world) if not torch.equal(rows[r], rows[0])]
    if not differ:
        return
    everyone = control.all_gather_object(mine)  # only on a mismatch: the details, to name them
    bad = differ[0]
    key, there, here = first_difference(everyone[0], everyone[bad])
    others = f" (ranks {differ} differ from rank 0 in all)" if len(differ) > 1 else ""
    raise ValueError(
        f"rank {bad} was started with another model or configuration than rank 0{others}: first "
        f"difference {key}: {there} on rank 0, {here} on rank {bad}. Every rank must build the same model "
        f"and pass the same EngineConfig (same script, flags and seed on every node); fix rank {bad}'s "
        f"command line or config and restart all ranks")
