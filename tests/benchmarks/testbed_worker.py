"""Worker for tests/benchmarks/test_testbed.py: moves a fixed payload over gloo and reports timing.

Started by Testbed.popen inside a worker namespace; reads TESTBED_RANK/TESTBED_WORLD_SIZE and
MASTER_ADDR from the environment the testbed sets. Prints one JSON line on stdout.
"""

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--mbytes", type=float, default=4.0, help="all_to_all input per rank, MB")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=8, help="async pieces per all_to_all")
    a = ap.parse_args()

    rank, world = int(os.environ["TESTBED_RANK"]), int(os.environ["TESTBED_WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{a.port}",
        rank=rank, world_size=world, timeout=timedelta(seconds=60))

    n = int(a.mbytes * 1e6) // 4 // (world * a.chunks) * (world * a.chunks)
    x = torch.full((n,), float(rank))
    y = torch.empty_like(x)
    xs, ys = x.chunk(a.chunks), y.chunk(a.chunks)
    small = torch.zeros(world * 16)
    dist.all_to_all_single(torch.empty_like(small), small)  # connect all pairs before timing
    dist.barrier()

    t0 = time.perf_counter()
    for _ in range(a.iters):
        works = [dist.all_to_all_single(yo, xi, async_op=True) for xi, yo in zip(xs, ys)]
        for w in works:
            w.wait()
    dt = time.perf_counter() - t0
    dist.barrier()

    # every peer's slice of y must hold that peer's rank
    expect = torch.arange(world, dtype=torch.float32).repeat_interleave(n // a.chunks // world)
    ok = all(torch.equal(yc, expect) for yc in ys)
    sent = a.iters * 4 * n * (world - 1) // world  # bytes this rank put on its link
    print(json.dumps({"rank": rank, "seconds": dt, "payload_bytes": sent,
                      "mbit_s": sent * 8 / dt / 1e6, "ok": ok}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
