"""One-command GPU acceptance (docs/DESIGN.md section 10): what a first day on a GPU must show.

    python benchmarks/gpu_check.py --json docs/results/gpu_check_<gpu>.json

On one CUDA GPU, in under 10 minutes, it runs and records:

1. ``gpu_tests``: the GPU-marked tests (tests/engine/test_gpu.py: streams against the
   reference with poisoned buffers, CPU batches placed by the engine, the micro-batch loop under
   ``torch.cuda.set_sync_debug_mode("error")``, the CUDA-event clock, bf16 compute; NCCL at
   world 2 if there are two GPUs), their pass/fail/skip counts;
2. ``finetune``: the fine-tuning recipe (recipes/finetune.py, the tiny GPT-2, README.md as its
   text) for 5 steps on the GPU: its train losses, finite, and its wall time;
3. ``overlap``: an ACCO step against a plain (zero1) step at world 1 on an MLP of about 130M
   parameters: seconds per step each and their ratio (target: ACCO within 5% of plain);
4. ``codecs``: quantize + pack and decode of int8 / int4 / int2 / sign1 (groups of 128, fp32
   scales) and top-k (chunk 4096, density 0.02, 2-bit values), GB/s of fp32 input, against a
   device-to-device copy of the same fp32 buffer (target: >= 70% of the copy); the int and sign
   codecs also through ``torch.compile`` (Triton), checked against eager (bit for bit; sign1's
   scale within 4 eps);
5. ``memory``: bytes per parameter the engine holds after a few steps (``memory_allocated``),
   per strategy, against the formulas of README.md and docs/DESIGN.md section 3.1.

Without a CUDA device it exits with status 2 and says so: nothing here means anything on CPU.
Exit status 1 if a part failed (its error is in the JSON), 0 otherwise; the targets are
reported (``meets_target``), not enforced.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

NO_CUDA = ("gpu_check: no CUDA device here (torch.cuda.is_available() is False). This check measures the "
           "GPU path and needs one NVIDIA GPU with a CUDA build of PyTorch; on CPU run the test suite instead.")


# ------------------------------------------------------------------------------ formulas
def formula_bytes_per_param(strategy: str, world: int = 1, compute_bytes: int = 4) -> float:
    """What README.md / docs/DESIGN.md section 3.1 say a worker holds per parameter, fp32 optimizer
    state: zero1 16 + 12/N (compute params, gathered params, two gradient buffers; master and two
    moments sharded); acco adds its kept half (4/N) and the second reduced-shard buffer (4/N);
    diloco / sparseloco 40 (section 8.5)."""
    replicated = 4 * compute_bytes
    if strategy == "zero1":
        return replicated + 12 / world
    if strategy == "acco":
        return replicated + 20 / world
    if strategy in ("diloco", "sparseloco"):
        return 40.0
    raise ValueError(f"no formula for {strategy!r}")


# ------------------------------------------------------------------------------ timing
def _device_time(fn, repeats: int, device: torch.device, warmup: int = 3) -> float:
    """Median seconds per call, from CUDA events around each call (perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type != "cuda":
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ the parts
def gpu_tests(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                               f"--junitxml={xml}", "tests/engine/test_gpu.py"], cwd=ROOT,
                              capture_output=True, text=True, timeout=args.part_timeout_s,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        cases = []
        if os.path.exists(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                status = "passed"
                for tag in ("failure", "error", "skipped"):
                    if case.find(tag) is not None:
                        status = tag
                cases.append({"name": case.get("name"), "status": status})
    counts = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failure", "error", "skipped")}
    return {"ok": proc.returncode == 0 and counts["passed"] > 0, "returncode": proc.returncode, **counts,
            "cases": cases, "wall_s": time.perf_counter() - t0, "output_tail": proc.stdout[-3000:] + proc.stderr[-2000:]}


def finetune(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "recipes/finetune.py", "--model", "tiny-gpt2", "--dataset",
                               str(ROOT / "README.md"), "--max-steps", "5", "--output-dir", os.path.join(tmp, "run"),
                               "--eval-batches", "1", "--seq-len", "128", "--micro-batch-size", "8"],
                              cwd=ROOT, capture_output=True, text=True, timeout=args.part_timeout_s,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
        metrics = Path(tmp, "run", "metrics.jsonl")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in rows if r.get("kind") == "train"]
    losses = [r["loss"] for r in train]
    ok = proc.returncode == 0 and len(train) == 5 and all(isinstance(v, float) and v == v for v in losses)
    return {"ok": ok, "returncode": proc.returncode, "steps": len(train), "losses": losses,
            "step_time_s": [r["time_s"] for r in train], "wall_s": wall,
            "output_tail": proc.stdout[-2000:] + proc.stderr[-2000:]}


def _mlp(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def overlap(args) -> dict:
    from engine import Engine, EngineConfig

    width, depth, batch, k, steps, skip = (64, 2, 8, 2, 5, 1) if args.small else (4096, 8, 256, 4, 12, 4)
    dev = torch.device(args.device)
    x = torch.randn(batch, width, device=dev)
    data = [(x, x)] * (k * steps * 2 + 8)
    out = {}
    for strategy in ("zero1", "acco"):
        model = _mlp(width, depth).to(dev)
        cfg = EngineConfig(strategy=strategy, lr=1e-4, micro_batches=k, accumulation="fixed", max_steps=steps)
        engine = Engine(model, cfg, _mse)
        history = engine.fit(iter(data))
        engine.close()
        _free()
        times = [h["time_s"] for h in history][skip:]
        out[strategy] = {"step_s": statistics.median(times), "steps": len(history)}
        del engine, model
        _free()
    ratio = out["acco"]["step_s"] / out["zero1"]["step_s"]
    params = depth * (width * width + width)
    return {"ok": True, "params": params, "micro_batches": k, "batch": batch, **out,
            "acco_over_plain": ratio, "target": "acco step <= 1.05 x plain step", "meets_target": ratio <= 1.05}


def codecs(args) -> dict:
    from acco_loco.registry import make_codec
    from acco_loco.topk_codec import TopKCodec

    dev = torch.device(args.device)
    n = 1 << (14 if args.small else args.codec_log2)
    x = torch.randn(n, device=dev)
    dst = torch.empty_like(x)
    copy_s = _device_time(lambda: dst.copy_(x), args.repeats, dev)
    gbps = lambda s: 4 * n / s / 1e9  # noqa: E731  fp32 input bytes per second
    rows = {"copy": {"gb_s": gbps(copy_s)}}
    for name in ("int8", "int4", "int2", "sign1"):
        codec = make_codec(name, group_size=128)
        payload, scales = codec.encode(x, check_finite=False)
        enc = _device_time(lambda: codec.encode(x, check_finite=False), args.repeats, dev)
        dec = _device_time(lambda: codec.decode(payload, scales, out=dst), args.repeats, dev)
        rows[name] = {"encode_gb_s": gbps(enc), "decode_gb_s": gbps(dec),
                      "encode_vs_copy": copy_s / enc, "decode_vs_copy": copy_s / dec}
        if args.compile:  # the same torch source through Inductor (Triton on a GPU): bits, then speed
            torch._dynamo.reset()
            c_enc = torch.compile(lambda t: codec.encode(t, check_finite=False), dynamic=False)
            c_dec = torch.compile(lambda p, sc, o: codec.decode(p, sc, out=o), dynamic=False)
            cp, cs = c_enc(x)
            if name == "sign1":  # a root mean square: summed in Inductor's order (tests/engine/test_compiled_codecs.py)
                close = (cs - scales).abs() <= 4 * torch.finfo(torch.float32).eps * scales.abs()
                same = torch.equal(cp, payload) and bool(close.all())
            else:
                same = torch.equal(cp, payload) and torch.equal(cs, scales)
            c_dec(payload, scales, dst)
            same = same and torch.equal(dst, codec.decode(payload, scales))
            enc = _device_time(lambda: c_enc(x), args.repeats, dev)
            dec = _device_time(lambda: c_dec(payload, scales, dst), args.repeats, dev)
            rows[name]["compiled"] = {"equal_to_eager": same, "encode_gb_s": gbps(enc), "decode_gb_s": gbps(dec),
                                      "encode_vs_copy": copy_s / enc, "decode_vs_copy": copy_s / dec}
    topk = TopKCodec(chunk=4096, density=0.02, bits=2)
    payload = topk.encode(x)
    enc = _device_time(lambda: topk.encode(x), args.repeats, dev)
    dec = _device_time(lambda: topk.decode(payload, n), args.repeats, dev)
    rows["topk"] = {"encode_gb_s": gbps(enc), "decode_gb_s": gbps(dec), "encode_vs_copy": copy_s / enc,
                    "decode_vs_copy": copy_s / dec}
    worst = min(min(r["encode_vs_copy"], r["decode_vs_copy"]) for k, r in rows.items() if k != "copy")
    compiled = [r["compiled"] for r in rows.values() if "compiled" in r]
    out = {"ok": all(c["equal_to_eager"] for c in compiled), "values": n, "codecs": rows, "worst_vs_copy": worst,
           "target": ">= 0.70 of the copy", "meets_target": worst >= 0.70}
    if compiled:
        out["compiled_worst_vs_copy"] = min(min(c["encode_vs_copy"], c["decode_vs_copy"]) for c in compiled)
    return out


def memory(args) -> dict:
    from engine import Engine, EngineConfig

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"  # on CPU (the smoke run) the engines run, nothing is measured
    width, depth = (64, 2) if args.small else (2048, 12)
    rows = {}
    for strategy in ("zero1", "acco", "diloco", "sparseloco"):
        _free()
        base = torch.cuda.memory_allocated() if cuda else 0
        model = _mlp(width, depth).to(dev)
        params = sum(p.numel() for p in model.parameters())
        extra = dict(inner_steps=2) if strategy in ("diloco", "sparseloco") else {}
        cfg = EngineConfig(strategy=strategy, lr=1e-4, micro_batches=1, accumulation="fixed", max_steps=4, **extra)
        engine = Engine(model, cfg, _mse)
        x = torch.randn(4, width, device=dev)
        steps = len(engine.fit(iter([(x, x)] * 16)))
        held = (torch.cuda.memory_allocated() - base) / params if cuda else None
        want = formula_bytes_per_param(strategy)
        rows[strategy] = {"steps": steps, "bytes_per_param": held, "formula": want,
                          "ratio": held / want if cuda else None}
        engine.close()
        del engine, model
    _free()
    out = {"ok": all(r["steps"] == 4 for r in rows.values()), "params": params, "world": 1, "strategies": rows}
    if cuda:
        out["meets_target"] = all(0.9 <= r["ratio"] <= 1.1 for r in rows.values())
    return out


PARTS = {"gpu_tests": gpu_tests, "finetune": finetune, "overlap": overlap, "codecs": codecs, "memory": memory}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--codec-log2", type=int, default=26, help="values per codec buffer, log2 (26: 256 MB fp32)")
    ap.add_argument("--part-timeout-s", type=float, default=240.0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of this script's code paths (the tests use it); its numbers mean nothing")
    ap.add_argument("--small", action="store_true", help="tiny sizes (with --device cpu: the smoke run)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile'd int/sign codecs (about 10 compiles)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (smoke run: no figures)",
              "gpus": torch.cuda.device_count(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.perf_counter()
    failed = False
    for name in args.parts:
        t = time.perf_counter()
        try:
            report[name] = PARTS[name](args)
        except Exception as exc:  # one part's failure must not hide the others
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        report[name]["part_s"] = time.perf_counter() - t
        failed |= not report[name]["ok"]
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['part_s']:.0f} s)"
              + (f" meets target: {report[name]['meets_target']}" if "meets_target" in report[name] else ""))
    report["total_s"] = time.perf_counter() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json} ({report['total_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
