"""Checkpoints without a shared filesystem: buddy copies at save, missing files from live peers at load.

The ranks that see the same checkpoint directory form a group: a node's own disk, or every rank on
a shared filesystem (one group). With two or more groups, the directory of group i also keeps the
rank files of group i + 1 (mod the number of groups), a buddy copy: the optimizer shards of a lost
node survive it on one other node. The cost: each directory holds twice its own ranks' rank files,
and a save sends every rank's file once to the lowest rank of the previous group (point-to-point
over the process group, on the compute side, before the files are written).

At load every rank lists the finished checkpoints and files it can read; the ranks agree on the
checkpoint that ``latest`` names when that one is complete across them (else the newest complete
one, with a warning), and every file a rank needs (engine.json, the model, its own rank file, or all
of them for a re-cut at another world size) but cannot read is sent to it by the lowest rank that
can. The needing rank reads a scratch directory of links to its own files and the received ones.
No path another node wrote is ever opened.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("acco_loco")

LATEST = "latest"  # the pointer file of a checkpoint root, naming its newest checkpoint
MODEL, INFO = "model.safetensors", "engine.json"


def rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


# ---------------------------------------------------------------------------- save: buddy copies
def directory_owners(owner: int, device: torch.device, group) -> list[int]:
    """Every rank's directory owner (the lowest rank that sees its directory), from each rank's own
    (``group``: the engine's control group, over every rank in rank order)."""
    mine = torch.tensor([owner], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def buddy_sources(owners: list[int], rank: int) -> list[int]:
    """The ranks whose files this rank keeps as a buddy copy: every rank of the next group when this
    rank owns its group's directory, else none. One group (a shared filesystem): none."""
    groups = sorted(set(owners))
    if len(groups) < 2 or owners[rank] != rank:
        return []
    following = groups[(groups.index(rank) + 1) % len(groups)]
    return [r for r, o in enumerate(owners) if o == following]


def buddy_of(owners: list[int], rank: int) -> int | None:
    """The rank that keeps this rank's buddy copy: the owner of the previous group."""
    groups = sorted(set(owners))
    if len(groups) < 2:
        return None
    return groups[(groups.index(owners[rank]) - 1) % len(groups)]


def exchange_buddy_copies(owners: list[int], rank: int, payload: bytes, device: torch.device,
                          group) -> dict[int, bytes]:
    """Send this rank's file (``payload``) to its buddy and receive the files it keeps as one:
    {source rank: bytes}. Sizes travel first in one all-gather; the files point-to-point."""
    world = len(owners)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    works, received = [], {}
    buddy = buddy_of(owners, rank)
    if buddy is not None:
        send = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        works.append(dist.isend(send, dst=buddy, tag=rank, group=group))
    for src in buddy_sources(owners, rank):
        received[src] = torch.empty(int(sizes[src].item()), dtype=torch.uint8, device=device)
        works.append(dist.irecv(received[src], src=src, tag=src, group=group))
    for work in works:
        work.wait()
    return {src: t.cpu().numpy().tobytes() for src, t in received.items()}


# ---------------------------------------------------------------------------- load: from peers
def inventory(directory: str | Path) -> dict:
    """The finished checkpoints this rank can read under ``directory`` (itself a checkpoint, or a
    root of ``step-*`` checkpoints): {"checkpoints": {name: {"step", "world", "files": {file: size}}},
    "latest": the root's pointer or None}. A name is "." when ``directory`` is the checkpoint."""
    root = Path(directory)
    found: dict[str, dict] = {}

    def add(name: str, path: Path) -> None:
        try:
            info = json.loads((path / INFO).read_text())
            step, world = int(info["step"]), int(info["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # unreadable here: a rank that reads it will send it, or the load says why
        files = {p.name: p.stat().st_size for p in path.iterdir()
                 if p.is_file() and (p.suffix == ".safetensors" or p.name == INFO)}
        found[name] = {"step": step, "world": world, "files": files}

    latest = None
    if (root / INFO).is_file():
        add(".", root)
    elif root.is_dir():
        for sub in sorted(root.iterdir()):
            if sub.is_dir() and not sub.name.endswith((".tmp", ".old")) and (sub / INFO).is_file():
                add(sub.name, sub)
        if (root / LATEST).is_file():
            latest = (root / LATEST).read_text().strip()
    return {"checkpoints": found, "latest": latest}


def _needed(world_saved: int, rank: int, world: int) -> list[str]:
    own = [rank_file(rank, world)] if world_saved == world else [rank_file(r, world_saved) for r in range(world_saved)]
    return [INFO, MODEL, *own]


def choose(inventories: list[dict], directory: str) -> tuple[str, dict[str, list[int]], int]:
    """(checkpoint name, {file: ranks that hold it}, saved world size), the same on every rank:
    ``latest``'s checkpoint when every rank that has a pointer names it and it is complete, else
    the newest complete one. Raises when none is complete, naming what is missing."""
    union: dict[str, dict] = {}
    for rank, inv in enumerate(inventories):
        for name, c in inv["checkpoints"].items():
            entry = union.setdefault(name, {"step": c["step"], "world": c["world"], "holders": {}})
            for f in c["files"]:
                entry["holders"].setdefault(f, []).append(rank)

    def missing(name: str) -> list[str]:
        entry = union[name]
        need = [INFO, MODEL] + [rank_file(r, entry["world"]) for r in range(entry["world"])]
        return [f for f in need if f not in entry["holders"]]

    if not union:
        raise FileNotFoundError(f"no checkpoint in {directory} on any rank (no complete one: engine.json is missing): "
                                "give a directory written by Engine.save or a checkpoint root")
    complete = sorted((n for n in union if not missing(n)), key=lambda n: union[n]["step"])
    pointers = {inv["latest"] for inv in inventories if inv["latest"]}
    newest = max(union, key=lambda n: union[n]["step"])
    if len(pointers) == 1 and next(iter(pointers)) in complete:
        name = next(iter(pointers))
    elif complete:
        name = complete[-1]
        if union[newest]["step"] > union[name]["step"] or len(pointers) > 1:
            log.warning("checkpoints in %s: the ranks' latest pointers are %s and %s lacks %s on every live "
                        "rank (lost with its node and its buddy); resuming from %s, the newest complete one",
                        directory, sorted(pointers), newest, missing(newest)[:6] or "nothing", name)
    else:
        raise FileNotFoundError(
            f"no checkpoint in {directory} is complete on the live ranks: {newest} lacks {missing(newest)[:6]} "
            "(lost with its node and the node that kept its buddy copy): resume from a checkpoint whose "
            "files survive, or with the lost node's disk back")
    return name, union[name]["holders"], union[name]["world"]


def gather_checkpoint(directory: str | Path, rank: int, world: int, device: torch.device,
                      diagnose, group) -> tuple[Path, Path | None]:
    """The checkpoint every rank agrees on, as a directory this rank can read: (path, scratch to
    remove after the load, or None when this rank's own files sufficed). ``diagnose(what)`` builds
    the error for a failed collective."""
    mine = inventory(directory)
    every: list = [None] * world
    try:
        dist.all_gather_object(every, mine, group=group)
    except Exception as exc:
        raise diagnose(f"listing the checkpoint files in {directory}") from exc
    name, holders, saved_world = choose(every, str(directory))
    here = Path(directory) if name == "." else Path(directory) / name
    local = set(mine["checkpoints"].get(name, {}).get("files", {}))
    plan = []  # (file, source, needing rank), the same order on every rank
    for r in range(world):
        for f in _needed(saved_world, r, world):
            if r not in holders[f]:
                plan.append((f, holders[f][0], r))
    if not any(rank in (src, dst) for _, src, dst in plan):
        return here, None
    works, received = [], {}
    try:
        for tag, (f, src, dst) in enumerate(plan):
            if src == rank:
                data = torch.frombuffer(bytearray((here / f).read_bytes()), dtype=torch.uint8).to(device)
                works.append((dist.isend(data, dst=dst, tag=tag, group=group), data))
            elif dst == rank:
                size = every[src]["checkpoints"][name]["files"][f]  # as the source lists it
                received[f] = torch.empty(size, dtype=torch.uint8, device=device)
                works.append((dist.irecv(received[f], src=src, tag=tag, group=group), received[f]))
        for work, _ in works:
            work.wait()
    except Exception as exc:
        raise diagnose(f"fetching checkpoint files of {here} from live peers") from exc
    if not received:
        return here, None
    scratch = Path(tempfile.mkdtemp(prefix="acco-loco-resume-"))
    view = scratch / (Path(directory).name if name == "." else name)
    view.mkdir()
    for f in local:
        (view / f).symlink_to((here / f).resolve())
    for f, data in received.items():
        (view / f).write_bytes(data.cpu().numpy().tobytes())
    log.warning("rank %d: %s came from live peers (this rank's disk lacks them): %s", rank, here,
                ", ".join(f"{f} from rank {holders[f][0]}" for f in sorted(received)))
    return view, scratch


def remove_scratch(scratch: Path | None) -> None:
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
