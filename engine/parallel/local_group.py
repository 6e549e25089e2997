"""Spawn a real gloo process group on this machine (tests, benchmarks): one process per rank,
results back by queue. The ranks fork from a server that imported torch once (``_context``). The
functions run must be importable (they are pickled by name)."""

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


def _context():
    """Ranks forked from a server that imported torch once (the standard library's forkserver): a
    rank starts in a fraction of a second instead of importing torch again, seconds on a small
    machine. The server imports nothing else, and a rank sets the caller's environment before it
    imports the function's module: it sees what a spawned rank would."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def _entry(work: bytes, rank, world, port, queue, env, caller_env):
    os.environ.clear()  # the caller's environment now, not the server's when it started
    os.environ.update(caller_env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    if "LOCAL_WORLD_SIZE" in env:  # nodes of G ranks, numbered node by node as torchrun does
        g = int(env["LOCAL_WORLD_SIZE"])
        os.environ.update({"LOCAL_RANK": str(rank % g), "GROUP_RANK": str(rank // g)})
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(work)  # imported here, under the environment above
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
    ctx, work = _context(), pickle.dumps((fn, args))
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(work, r, world, port, queue, env or {}, dict(os.environ)))
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

    ctx, work = _context(), pickle.dumps((fn, args))
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(work, r, world, port, queue, env or {}, dict(os.environ)))
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
