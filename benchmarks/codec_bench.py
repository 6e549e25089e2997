"""Throughput of the acco_loco codecs against a plain copy (the memory-bandwidth limit).

For each device, size and codec it times

* encode: quantize + pack (``codec.encode``, NaN/Inf check included in eager mode),
* decode: unpack + dequantize into a preallocated fp32 buffer (``codec.decode(out=...)``),
* accum:  decode added into a buffer (``accumulate=True``, the reduce-scatter's inner loop),

and prints GB/s of fp32 *input* (4 bytes per value / time) next to ``dst.copy_(src)`` of the
same fp32 size, and the ratio codec / copy.  A ratio of 1 would mean the codec runs at the
speed of a memcpy of its fp32 side.

    python benchmarks/codec_bench.py                      # CPU, and CUDA when available
    python benchmarks/codec_bench.py --sizes 20 22 24 --repeats 20 --device cuda --compile

Sizes below 64 are read as powers of two (``20`` -> 2**20 values).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from acco_loco.codecs import Codec  # noqa: E402
from acco_loco.registry import CODEC_BITS, make_codec  # noqa: E402


def _timeit(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds per call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _parse_sizes(values: list[str]) -> list[int]:
    sizes = []
    for v in values:
        n = int(float(v)) if "e" in v.lower() else int(v, 0)
        sizes.append(1 << n if n < 64 else n)
    return sizes


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["20", "22", "24"], help="values per buffer (or log2 if < 64)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cpu, plus cuda when available")
    grouped = [name for name in CODEC_BITS if isinstance(make_codec(name), Codec)]  # the group-wise families
    ap.add_argument("--codecs", nargs="+", default=grouped, choices=list(CODEC_BITS))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--scale-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd encode/decode (no NaN check)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for CPU runs")
    return ap


def _devices(ap: argparse.ArgumentParser, device: str) -> list[str]:
    if device == "auto":
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    return [device]


def _checked_sizes(ap: argparse.ArgumentParser, values: list[str], group_size: int) -> list[int]:
    sizes = _parse_sizes(values)
    for n in sizes:
        if n % group_size:
            ap.error(f"size {n} is not a multiple of --group-size {group_size}")
    return sizes


_Mode = tuple[str, Callable[[], object], Callable[[], object], Callable[[], object]]


def _modes(codec, x: torch.Tensor, out: torch.Tensor, compile_too: bool) -> list[_Mode]:
    """``(mode, encode, decode, accumulate)`` closures: eager, plus torch.compile'd ones."""
    payload, scales = codec.encode(x)
    modes: list[_Mode] = [
        (
            "eager",
            lambda: codec.encode(x),
            lambda: codec.decode(payload, scales, out=out),
            lambda: codec.decode(payload, scales, out=out, accumulate=True),
        )
    ]
    if compile_too:
        torch._dynamo.reset()  # fresh cache per codec and size: no recompile limit
        enc_c = torch.compile(lambda t: codec.encode(t, check_finite=False), dynamic=False)
        dec_c = torch.compile(lambda p, s, o: codec.decode(p, s, out=o), dynamic=False)
        acc_c = torch.compile(lambda p, s, o: codec.decode(p, s, out=o, accumulate=True), dynamic=False)
        modes.append(
            (
                "compiled",
                lambda: enc_c(x),
                lambda: dec_c(payload, scales, out),
                lambda: acc_c(payload, scales, out),
            )
        )
    return modes


def _print_header(device: torch.device) -> None:
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n[{label}]")
    header = f"{'values':>9} {'codec':>6} {'mode':>8} {'enc GB/s':>9} {'dec GB/s':>9} {'acc GB/s':>9} {'copy GB/s':>10} {'enc/copy':>9} {'dec/copy':>9} {'acc/copy':>9} {'wire B/val':>10}"
    print(header)
    print("-" * len(header))


def _bench_size(n: int, device: torch.device, args: argparse.Namespace) -> None:
    """One row per codec and mode for buffers of ``n`` values on ``device`` (freed on return)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, device=device, generator=gen)
    out = torch.empty_like(x)
    t_copy = _timeit(lambda: out.copy_(x), device, args.repeats)
    copy_gbs = 4 * n / t_copy / 1e9
    for name in args.codecs:
        codec = make_codec(name, group_size=args.group_size, scale_dtype=args.scale_dtype)
        for mode, enc, dec, acc in _modes(codec, x, out, args.compile):
            t_enc = _timeit(enc, device, args.repeats)
            t_dec = _timeit(dec, device, args.repeats)
            t_acc = _timeit(acc, device, args.repeats)
            enc_gbs, dec_gbs, acc_gbs = (4 * n / t / 1e9 for t in (t_enc, t_dec, t_acc))
            print(
                f"{n:>9} {name:>6} {mode:>8} {enc_gbs:>9.2f} {dec_gbs:>9.2f} {acc_gbs:>9.2f} {copy_gbs:>10.2f} "
                f"{enc_gbs / copy_gbs:>9.2f} {dec_gbs / copy_gbs:>9.2f} {acc_gbs / copy_gbs:>9.2f} "
                f"{codec.wire_bytes(n) / n:>10.4f}"
            )


def main(argv: list[str] | None = None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = _devices(ap, args.device)
    sizes = _checked_sizes(ap, args.sizes, args.group_size)

    print(f"torch {torch.__version__}, CPU threads {torch.get_num_threads()}, group {args.group_size}, {args.scale_dtype} scales, "
          f"median of {args.repeats}; GB/s = fp32 input bytes (4/value) per second")
    for dev_name in devices:
        device = torch.device(dev_name)
        _print_header(device)
        for n in sizes:
            _bench_size(n, device, args)


if __name__ == "__main__":
    main()
