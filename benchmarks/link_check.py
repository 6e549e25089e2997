"""Check what gloo gets out of a shaped testbed link.

Builds an benchmarks.testbed.Testbed, runs gloo all_to_all_single of --mbytes per rank --iters
times, each all_to_all split into 1, 8 and 16 pieces issued asynchronously (one large gloo
collective reaches only about half the line rate, docs/testbed.md), and prints the achieved rate per
chunking next to the shaped rate (the physical limit), the TCP goodput ceiling, and the veth
tx_bytes cross-check.

    python benchmarks/link_check.py --workers 2 --rate 100mbit
    python benchmarks/link_check.py --workers 2 --rate 1gbit --delay-ms 5   # needs netem

Measured on the 2-core dev VM (2 workers, default burst, 16 MB per rank, receiver-side
timing): one all_to_all reaches ~48-50% of the rate at both 100 Mbit and 1 Gbit; 8 pieces
82-86%, 16 pieces ~89% at 100 Mbit but 72-81% at 1 Gbit (per-op CPU on 2 cores; 32 pieces
drop to ~53% there). The halving is gloo's, not the shaping's: one gloo isend+irecv pair
in both directions at once also gets ~half per direction while one-way send reaches the
ceiling, independent of the tbf queue size (5/50/200 ms). Unshaped veth on 2 cores tops out
at ~1.7 Gbit/s per direction.

Needs root (network namespaces, tc). Rate is per worker link and direction: in an
all_to_all each rank sends and receives (N-1)/N of its buffer over its own link, so the
physical limit of one all_to_all is ((N-1)/N x bytes) / rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

# TCP payload per frame at MTU 1500: MSS 1448 (20 IP + 20 TCP + 12 timestamp option) in a
# 1514-byte Ethernet frame, which is what tbf counts against the rate.
def goodput_ceiling(mtu: int = 1500) -> float:
    return (mtu - 52) / (mtu + 14)


def _read_counter(name: str) -> int:
    # inside the worker's namespace (ip netns exec remounted /sys), so this is its own veth
    with open(f"/sys/class/net/{os.environ['TESTBED_IFNAME']}/statistics/{name}") as f:
        return int(f.read())


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["TESTBED_RANK"]), int(os.environ["TESTBED_WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{a.port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=300))
    chunkings = [int(c) for c in a.chunks.split(",")]
    lcm = math.lcm(*chunkings) * world
    n = max(lcm, int(a.mbytes * 1e6) // 4 // lcm * lcm)
    x = torch.randn(n)
    y = torch.empty_like(x)
    dist.all_to_all_single(torch.empty(world * 64), torch.zeros(world * 64))  # connect pairs
    results = []
    for chunks in chunkings:
        xs, ys = x.chunk(chunks), y.chunk(chunks)

        def step():
            works = [dist.all_to_all_single(yo, xi, async_op=True) for xi, yo in zip(xs, ys)]
            for w in works:
                w.wait()

        step()  # warm-up: TCP windows, gloo buffers
        dist.barrier()
        tx0, rx0 = _read_counter("tx_bytes"), _read_counter("rx_bytes")
        t0 = time.perf_counter()
        for _ in range(a.iters):
            step()
        dt = time.perf_counter() - t0
        tx, rx = _read_counter("tx_bytes") - tx0, _read_counter("rx_bytes") - rx0
        times = torch.tensor([dt])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the collective ends at the slowest rank
        payload = a.iters * 4 * n * (world - 1) // world
        results.append({"chunks": chunks, "seconds": float(times), "payload": payload,
                        "tx_bytes": tx, "rx_bytes": rx})
    print(json.dumps({"rank": rank, "results": results}), flush=True)
    dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rate", default="100mbit", help="tc rate per worker link and direction")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link direction")
    ap.add_argument("--burst", default=None, help="tbf burst (default max(rate x 4 ms, 128 KiB))")
    ap.add_argument("--queue-ms", type=float, default=50.0, help="tbf latency (queue size)")
    ap.add_argument("--mbytes", type=float, default=16.0, help="all_to_all buffer per rank, MB")
    ap.add_argument("--iters", type=int, default=0, help="all_to_alls per chunking (0: ~3 s worth)")
    ap.add_argument("--chunks", default="1,8,16")
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--prefix", default="alc")
    ap.add_argument("--no-pin", action="store_true", help="do not taskset rank r to CPU r %% ncpu")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def _measure(a: argparse.Namespace, link) -> tuple[list[dict], list[int], list[dict]]:
    """Run the workers in a testbed: their JSON results, veth tx bytes and tbf stats per rank."""
    from benchmarks.testbed import Testbed

    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--port", str(a.port),
            "--mbytes", str(a.mbytes), "--iters", str(a.iters), "--chunks", a.chunks]
    ncpu = os.cpu_count() or 1
    with Testbed(workers=a.workers, link=link, prefix=a.prefix) as tb:
        before = [tb.tx_bytes(r) for r in range(a.workers)]
        procs = [tb.popen(r, argv, cpu=None if a.no_pin else str(r % ncpu),
                          stdout=subprocess.PIPE, text=True) for r in range(a.workers)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"link_check: a worker failed (exit codes {[p.returncode for p in procs]})")
        total_tx = [tb.tx_bytes(r) - before[r] for r in range(a.workers)]
        qstats = [tb.qdisc_stats(r) for r in range(a.workers)]
    res = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    return res, total_tx, qstats


def _print_setup(a: argparse.Namespace, link, per_iter: float) -> None:
    rate_mbit = link.rate_bps / 1e6
    ceil = goodput_ceiling(link.mtu)
    print(f"\n{a.workers} workers, {a.rate} per link and direction "
          f"(tbf burst {link.burst_bytes} B, queue {a.queue_ms:g} ms"
          + (f", delay {a.delay_ms:g} ms per direction" if a.delay_ms else "") + "), "
          f"all_to_all of {a.mbytes:g} MB/rank x {a.iters}, "
          f"{per_iter / 1e6:.2f} MB sent per rank per all_to_all")
    print(f"physical limit {rate_mbit:g} Mbit/s; TCP goodput ceiling {rate_mbit * ceil:.1f} "
          f"Mbit/s (x{ceil:.3f}: headers of 1514-byte frames)")


def _print_table(a: argparse.Namespace, link, per_iter: float, res: list[dict]) -> None:
    """One row per chunking: the slowest rank's time against the shaped rate and the ceiling."""
    rate_mbit = link.rate_bps / 1e6
    ceil = goodput_ceiling(link.mtu)
    hdr = (f"{'chunks':>6} {'s/all_to_all':>12} {'limit s':>8} {'Mbit/s':>8} {'% rate':>7} "
           f"{'% ceiling':>9} {'tx/payload':>10}")
    print(hdr)
    print("-" * len(hdr))
    for i, r0 in enumerate(res[0]["results"]):
        secs = max(r["results"][i]["seconds"] for r in res)
        payload = r0["payload"]
        mbit = payload * 8 / secs / 1e6
        txr = max(r["results"][i]["tx_bytes"] for r in res) / payload
        print(f"{r0['chunks']:>6} {secs / a.iters:>12.3f} {per_iter * 8 / link.rate_bps:>8.3f} "
              f"{mbit:>8.1f} {100 * mbit / rate_mbit:>6.1f}% {100 * mbit / (rate_mbit * ceil):>8.1f}% "
              f"{txr:>10.4f}")


def _print_totals(a: argparse.Namespace, res: list[dict], total_tx: list[int], qstats: list[dict]) -> None:
    payload_all = sum(r["payload"] for r in res[0]["results"])
    print(f"whole run, worker 0: tx_bytes read from its namespace {total_tx[0]} vs payload "
          f"{payload_all} (+warm-ups {payload_all // a.iters}), tbf drops "
          f"up {qstats[0]['up'].get('drops')} down {qstats[0]['down'].get('drops')}")


def main() -> None:
    a = _parser().parse_args()
    if a.worker:
        return worker(a)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.testbed import LinkSpec, requires_root_reason

    reason = requires_root_reason(delay=a.delay_ms > 0)
    if reason:
        sys.exit(f"link_check: {reason}")
    link = LinkSpec(a.rate, delay_ms=a.delay_ms, burst=a.burst, queue_ms=a.queue_ms)
    per_iter = a.mbytes * 1e6 * (a.workers - 1) / a.workers  # bytes per rank per all_to_all
    if a.iters <= 0:
        a.iters = max(3, math.ceil(3.0 * link.rate_bps / 8 / per_iter))
    res, total_tx, qstats = _measure(a, link)
    _print_setup(a, link, per_iter)
    _print_table(a, link, per_iter, res)
    _print_totals(a, res, total_tx, qstats)


if __name__ == "__main__":
    main()
