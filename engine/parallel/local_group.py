"""Spawn a real gloo process group on this machine (tests, benchmarks): one process per rank,
results back by queue. The functions run must be importable (spawn pickles them by name)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, queue, args, env):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    if "LOCAL_WORLD_SIZE" in env:  # nodes of G ranks, numbered node by node as torchrun does
        g = int(env["LOCAL_WORLD_SIZE"])
        os.environ.update({"LOCAL_RANK": str(rank % g), "GROUP_RANK": str(rank // g)})
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        out = fn(rank, world, *args)
    except BaseException as exc:  # report, then exit non-zero as a user's script would
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    # pickled by value: torch's shared-memory tensor passing dies with this process
    queue.put((rank, "ok", pickle.dumps(out)))


def spawn(fn, world: int, *args, timeout: float = 180, env: dict | None = None) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; return results by rank.

    Raises AssertionError with every failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, env or {}))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    try:
        for _ in range(world):
            rank, status, out = queue.get(timeout=timeout)
            results[rank] = (status, out)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: out for r, (status, out) in results.items() if status != "ok"}
    assert not errors, "worker failures:\n" + "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    return [pickle.loads(results[r][1]) for r in range(world)]


def spawn_collect(fn, world: int, *args, timeout: float = 120, env: dict | None = None) -> list[dict]:
    """Like spawn, but failures are data: per rank {status, out, exitcode, elapsed}."""
    import time

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, env or {}))
             for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    ended: dict[int, float] = {}
    while len(ended) < world and time.monotonic() - start < timeout:
        for r, p in enumerate(procs):
            if r not in ended and not p.is_alive():
                ended[r] = time.monotonic() - start
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    got: dict[int, tuple] = {}
    while not queue.empty():
        rank, status, out = queue.get()
        got[rank] = (status, pickle.loads(out) if status == "ok" else out)
    return [{"status": got.get(r, ("none", None))[0], "out": got.get(r, ("none", None))[1],
             "exitcode": procs[r].exitcode, "elapsed": ended.get(r)} for r in range(world)]
