"""The parts of benchmarks/gpu_check.py, one function each: ``part(args) -> dict`` with ``ok``.
gpu_check runs each in its own process with a time limit; here they are plain functions. With
``--device cpu`` the parts that can run there do (the smoke run the tests make: figures mean
nothing); the CUDA-only ones say so."""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ helpers
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


def _mlp(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


# ------------------------------------------------------------------------------ NCCL at world 1
def nccl_world1(args) -> dict:
    """NCCL with the world-1 shortcut off: at world 1 ``Comm`` skips every collective, so the
    collectives the engine issues are called here directly, from the engine's comm thread on its
    stream, as async works; then the user's collectives on the default group (the compute stream)
    while the comm thread's run on a group of the engine's own (engine/parallel/dims.py: separate
    communicators and streams), both to their end; then the abort that ends a lost peer's
    collectives."""
    import torch.distributed as dist

    from engine.parallel.comm import prepare_backend
    from engine.parallel.local_group import free_port
    from engine.runtime import host
    from engine.runtime.streams import CommWorker

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"})
    dist.init_process_group("nccl", init_method="env://", timeout=prepare_backend("nccl", 30.0), device_id=dev)
    worker = CommWorker(dev, timeout_s=30.0)
    x = torch.randn(1 << 20, device=dev)

    def exchange():
        stream = torch.cuda.current_stream()
        recv, gathered, summed = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        small = x[:8].double().clone()
        works = [dist.all_to_all_single(recv, x, async_op=True),
                 dist.all_gather_into_tensor(gathered, x, async_op=True),
                 dist.reduce_scatter_tensor(summed, x, async_op=True),
                 dist.all_reduce(small, async_op=True)]
        for w in works:
            w.wait()  # orders this stream after the collective; never blocks the host
        equal = host.to_host(torch.stack([(recv == x).all(), (gathered == x).all(), (summed == x).all(),
                                          (small == x[:8].double()).all()]))
        return {"on_comm_stream": stream == worker.stream, "equal": [bool(v) for v in equal]}
    got = worker.submit(0, exchange).wait(60.0)
    torch.cuda.synchronize()
    got["user_beside_engine"] = _user_beside_engine(worker, dev)
    if getattr(args, "result", None):  # kept if NCCL's watchdog ends the process at the abort
        Path(args.result).write_text(json.dumps({"ok": False, **got, "error": "the process ended at the abort"}))
    aborted = worker.abort()
    after = worker.submit(2, lambda: dist.all_reduce(torch.ones(1, device=dev)))
    try:
        after.wait(30.0)
        torch.cuda.synchronize()
        after_abort = "a collective still ran after the abort"
    except Exception as exc:  # what the engine sees after aborting: an error, not a hang
        after_abort = f"{type(exc).__name__}: {str(exc)[:200]}"
    closed = worker.close(timeout_s=10.0)
    ok = (got["on_comm_stream"] and all(got["equal"]) and got["user_beside_engine"]["ok"] and aborted and closed
          and "still ran" not in after_abort)
    return {"ok": ok, **got, "aborted": aborted, "after_abort": after_abort, "comm_thread_closed": closed}


def _user_beside_engine(worker, dev, rounds: int = 50) -> dict:
    """``rounds`` all-reduces on an engine group from the comm thread (its stream) while the main
    thread runs as many on the default group (the compute stream): both finish, with the sums."""
    import torch.distributed as dist

    from engine.parallel.dims import ParallelDims
    from engine.parallel.topology import Layout
    from engine.runtime import host

    group = ParallelDims(Layout(1), "flat", 0, 1, dev, 30.0).comm("world", group_of_one=True).group

    def engine_side():
        t = torch.ones(1 << 16, device=dev)
        for _ in range(rounds):
            dist.all_reduce(t, group=group)
        return float(host.to_host(t[:1])[0])

    t0 = time.perf_counter()
    pending = worker.submit(1, engine_side)
    mine = torch.ones(1 << 16, device=dev)
    for _ in range(rounds):
        dist.all_reduce(mine)  # the user's: a metric, a logger
    user = float(mine[0].item())
    engine = pending.wait(60.0)
    torch.cuda.synchronize()
    return {"ok": user == 1.0 and engine == 1.0, "user_sum": user, "engine_sum": engine,
            "seconds": round(time.perf_counter() - t0, 3)}


# ------------------------------------------------------------------------------ two processes, one GPU, gloo
def _gloo_pair_worker(rank: int, world: int, device: str, steps: int):
    import torch.distributed as dist

    from engine import Engine, EngineConfig
    from tests.tiny import mse_loss, tiny_model, worker_stream

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    model = tiny_model(0).to(device)
    cfg = EngineConfig(strategy="acco", codec="loco4", param_codec="int8", lr=1e-2, micro_batches=2,
                       accumulation="fixed", max_steps=steps, align=8, group_size=8, timeout_s=60.0)
    engine = Engine(model, cfg, mse_loss)
    history = engine.fit(worker_stream(rank, 10 * steps))  # CPU batches: the engine places them
    engine.close()
    return {"params": _flat(model), "losses": [h["loss"] for h in history],
            "stream": engine.worker.stream is not None, "wire_bytes": sum(h["wire_bytes"] for h in history)}


def gloo_pair(args) -> dict:
    """Two processes share the GPU over a gloo group (NCCL refuses one GPU twice): CUDA compute,
    the comm stream, and the multi-rank compressed path (ACCO, loco4 gradients, int8 parameters)."""
    from engine.parallel.local_group import spawn

    steps = 4
    a, b = spawn(_gloo_pair_worker, 2, args.device, steps, timeout=args.part_limit_s)
    same = torch.equal(a["params"], b["params"])
    finite = bool(torch.isfinite(a["params"]).all())
    ok = same and finite and len(a["losses"]) == steps and a["wire_bytes"] > 0
    return {"ok": ok, "replicas_equal": same, "finite": finite, "losses": a["losses"],
            "comm_stream": a["stream"], "wire_bytes": [a["wire_bytes"], b["wire_bytes"]]}


# ------------------------------------------------------------------------------ syncs per step
def sync_debug(args) -> dict:
    """A whole ``fit`` under ``torch.cuda.set_sync_debug_mode("warn")``: the synchronising calls
    it makes, per step, and where (both threads: warnings are process-wide)."""
    from engine import Engine, EngineConfig
    from tests.tiny import mse_loss, tiny_model, worker_stream

    dev = torch.device(args.device)
    out, steps = {}, 6
    for name, kw in {"zero1": dict(strategy="zero1"),
                     "acco_loco4": dict(strategy="acco", codec="loco4", param_codec="int8", group_size=8),
                     "diloco": dict(strategy="diloco", inner_steps=3)}.items():
        engine = Engine(tiny_model(0).to(dev), EngineConfig(lr=1e-2, micro_batches=2, accumulation="fixed",
                                                            max_steps=steps, align=8, **kw), mse_loss)
        batches = worker_stream(0, 10 * steps)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                history = engine.fit(batches)
            finally:
                if dev.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        engine.close()
        # the mode's own "prototype feature" notice is no sync; Inductor's pattern passes read
        # the host once per compile (the first step), which is no cost per step
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()
                 and "debug mode is a prototype" not in str(w.message)]
        compiling = [w for w in syncs if any(f"{os.sep}{d}{os.sep}" in w.filename for d in COMPILER_DIRS)]
        running = [w for w in syncs if w not in compiling]
        sites: dict[str, int] = {}
        for w in running:
            site = f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
        out[name] = {"steps": len(history), "syncs": len(running), "syncs_per_step": len(running) / max(len(history), 1),
                     "compile_syncs": len(compiling), "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])[:8])}
    return {"ok": all(r["steps"] == steps for r in out.values()), "strategies": out,
            "meets_target": all(r["syncs"] == 0 for r in out.values()),
            "target": "no blocking call while training (compile-time reads by Inductor counted apart)",
            "note": "a round's two sanctioned reads (engine/runtime/host.py) are asynchronous copies + event polls, "
                    "which the debug mode does not count; what it counts is a blocking call"}


COMPILER_DIRS = ("_inductor", "_dynamo")  # torch's compiler: where compile-time host reads come from


# ------------------------------------------------------------------------------ codecs
def _codec_data(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n // 128).repeat_interleave(128)
    x[128:256] = 0.0  # an all-zero group
    return x


def codecs(args) -> dict:
    """Bits on the device against the CPU (the same input; sign1's scale, a root mean square
    summed in another order, within 4 eps), then GB/s of fp32 input of the engine's encode +
    error feedback, eager and compiled (acco_loco/compiled.py), against a device copy."""
    from acco_loco.feedback import ErrorFeedback
    from acco_loco.registry import make_codec
    from acco_loco.topk_codec import TopKCodec

    dev = torch.device(args.device)
    n = 1 << (14 if args.small else args.codec_log2)
    x_cpu = _codec_data(n)
    x = x_cpu.to(dev)
    eps = torch.finfo(torch.float32).eps
    rows, bits_ok = {}, True
    dst = torch.empty_like(x)
    copy_s = _device_time(lambda: dst.copy_(x), args.repeats, dev)
    gbps = lambda s: 4 * n / s / 1e9  # noqa: E731
    rows["copy"] = {"gb_s": gbps(copy_s)}
    for name in ("int8", "int4", "int2", "sign1"):
        codec = make_codec(name, group_size=128)
        p_dev, s_dev = codec.encode(x, check_finite=False)
        p_cpu, s_cpu = codec.encode(x_cpu, check_finite=False)
        if name == "sign1":
            same = torch.equal(p_dev.cpu(), p_cpu) and bool(((s_dev.cpu() - s_cpu).abs() <= 4 * eps * s_cpu.abs()).all())
        else:
            same = torch.equal(p_dev.cpu(), p_cpu) and torch.equal(s_dev.cpu(), s_cpu)
        bits_ok &= same
        feedback = ErrorFeedback("loco", n, device=dev)
        step = _feedback_step(codec, feedback, compiled=False)
        rows[name] = {"bits_equal_cpu": same, "encode_feedback_gb_s": gbps(_device_time(lambda: step(x), args.repeats, dev))}
        if args.compile:
            from acco_loco import compiled as compiled_codecs

            compiled_codecs.reset()  # each codec's compile judged on its own
            fast = _feedback_step(codec, ErrorFeedback("loco", n, device=dev), compiled=True)
            rows[name]["compiled_gb_s"] = gbps(_device_time(lambda: fast(x), args.repeats, dev))
            rows[name]["compiled_vs_copy"] = copy_s / _device_time(lambda: fast(x), args.repeats, dev)
            rows[name]["compile_failed"] = compiled_codecs.failed  # None: the compiled code ran
            if dev.type == "cuda" and compiled_codecs.failed is None:
                try:
                    rows[name].update(_compiled_diagnosis(codec, x, args.repeats))
                except Exception as exc:  # a diagnosis, not the check: keep the part's figures
                    rows[name]["diagnosis_error"] = f"{type(exc).__name__}: {exc}"[:500]
            bits_ok &= compiled_codecs.failed is None or dev.type != "cuda"
    topk = TopKCodec(chunk=4096, density=0.02, bits=2)
    same = torch.equal(topk.encode(x, check_finite=False).cpu(), topk.encode(x_cpu, check_finite=False))
    bits_ok &= same
    rows["topk"] = {"bits_equal_cpu": same,
                    "encode_gb_s": gbps(_device_time(lambda: topk.encode(x, check_finite=False), args.repeats, dev))}
    compiled = [r["compiled_vs_copy"] for r in rows.values() if "compiled_vs_copy" in r]
    out = {"ok": bits_ok, "values": n, "codecs": rows,
           "anchor": "torchao's blockwise fp8 quantizer: ~86% of H100 peak bandwidth"}
    if compiled:
        out["compiled_worst_vs_copy"] = min(compiled)
        out["meets_target"] = min(compiled) >= 0.5
        out["target"] = ">= 0.5 of a device copy (a copy reads and writes; encode reads x and e, writes e and a payload)"
    return out


def _feedback_step(codec, feedback, compiled: bool, pieces: int = 8):
    """The engine's encode + error feedback of one round as it runs on the device: the buffer in
    ``pieces`` pieces through ``ErrorFeedback.in_pieces`` (each piece copied to fp32 first, as
    the reducer does), eager or through acco_loco.compiled (the engine's compiled path)."""
    from acco_loco import compiled as compiled_codecs

    run = compiled_codecs.compress_piece if compiled else None

    def step(x, keep: list | None = None):
        size = -(-x.numel() // pieces // 128) * 128
        with feedback.in_pieces(codec, run=run) as piece:
            for a in range(0, x.numel(), size):
                out = piece(x[a:a + size].to(torch.float32, copy=True), a)
                if keep is not None:
                    keep.append(out)
    return step


def _compiled_diagnosis(codec, x: torch.Tensor, repeats: int) -> dict:
    """Where the compiled step's time goes: the same step in one piece (8 pieces' launches and
    guards against one), the kernels' own time (the profiler's CUDA time, per step: what the
    GPU spends, whatever the host's pace), and its bits against the eager step on the device."""
    from torch.profiler import ProfilerActivity, profile

    from acco_loco.feedback import ErrorFeedback

    dev, n = x.device, x.numel()
    gbps = lambda s: 4 * n / s / 1e9  # noqa: E731
    one = _feedback_step(codec, ErrorFeedback("loco", n, device=dev), compiled=True, pieces=1)
    out = {"compiled_one_piece_gb_s": gbps(_device_time(lambda: one(x), repeats, dev))}
    eight = _feedback_step(codec, ErrorFeedback("loco", n, device=dev), compiled=True)
    eight(x)
    torch.cuda.synchronize()
    calls = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            eight(x)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_s = sum(e.device_time for e in kernels) / 1e6 / calls  # device_time: microseconds
    names: dict[str, float] = {}
    for e in kernels:
        names[e.name[:60]] = names.get(e.name[:60], 0.0) + e.device_time / calls
    out.update(compiled_kernel_gb_s=gbps(busy_s), kernels_per_step=len(kernels) / calls,
               top_kernels_us=dict(sorted(names.items(), key=lambda kv: -kv[1])[:6]))
    eager_out, fast_out = [], []
    eager_fb, fast_fb = ErrorFeedback("loco", n, device=dev), ErrorFeedback("loco", n, device=dev)
    for _ in range(2):  # the second pass compensates with the first's error
        eager_out.clear(), fast_out.clear()
        _feedback_step(codec, eager_fb, compiled=False)(x, eager_out)
        _feedback_step(codec, fast_fb, compiled=True)(x, fast_out)
    out["compiled_bits_equal_eager"] = all(torch.equal(a, b) for ea, fa in zip(eager_out, fast_out)
                                           for a, b in zip(ea[:2], fa[:2]))
    # where they differ, by how much: codes one apart at a rounding midpoint (Triton's fp32
    # division is within 2 ulp, not rounded to nearest) are a valid quantization, anything else a bug
    step = [(codec._codes(ea[0]).int() - codec._codes(fa[0]).int()).abs() for ea, fa in zip(eager_out, fast_out)]
    out["compiled_codes_differing"] = sum(int((d > 0).sum()) for d in step) / n
    out["compiled_codes_max_step"] = max(int(d.max()) for d in step)
    out["compiled_scales_equal_eager"] = all(torch.equal(ea[1], fa[1]) for ea, fa in zip(eager_out, fast_out))
    return out


# ------------------------------------------------------------------------------ overlap
def _emulated_wire(engine, seconds: float, device: torch.device, cycles_per_s: float | None):
    """The round first holds its stream for a link's time: ``torch.cuda._sleep`` on the comm
    stream (a kernel that spins: the compute stream runs beside it), a sleep on CPU."""
    real = engine.strategy.run_round

    def slow(ctx, req):
        if device.type == "cuda":
            torch.cuda._sleep(int(seconds * cycles_per_s))
        else:
            time.sleep(seconds)
        return real(ctx, req)
    engine.strategy.run_round = slow


def _sleep_rate() -> float:
    """GPU cycles per second of ``torch.cuda._sleep``, measured with events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    a.record()
    torch.cuda._sleep(50_000_000)
    b.record()
    b.synchronize()
    return 50_000_000 / (a.elapsed_time(b) / 1e3)


def _fit_steps(strategy: str, k: int, steps: int, width: int, depth: int, batch: int, device: torch.device,
               wire_s: float, rate: float | None, skip: int) -> dict:
    from engine import Engine, EngineConfig

    model = _mlp(width, depth).to(device)
    engine = Engine(model, EngineConfig(strategy=strategy, lr=1e-4, micro_batches=k, accumulation="fixed",
                                        max_steps=steps), _mse)
    if wire_s:
        _emulated_wire(engine, wire_s, device, rate)
    x = torch.randn(batch, width, device=device)
    history = engine.fit(iter([(x, x)] * (k * steps * 2 + 8)))
    engine.close()
    times = [h["time_s"] for h in history][skip:]
    return {"step_s": statistics.median(times), "steps": len(history),
            "samples_per_step": history[-1]["samples"]}


def overlap(args) -> dict:
    """ACCO against zero1 at equal samples per step: an ACCO step is two rounds of k micro-batches,
    a zero1 step one round of 2k. The wire is emulated on the comm stream at 0.8 of k
    micro-batches' compute (zero1's no-wire step / 2): ACCO hides it when its step stays at the
    no-wire step; zero1 pays it. Step times are the engine's (CUDA events on the compute stream)."""
    dev = torch.device(args.device)
    width, depth, batch, k, steps, skip = (64, 2, 8, 2, 5, 1) if args.small else (4096, 8, 256, 4, 12, 4)
    rate = _sleep_rate() if dev.type == "cuda" else None
    base = _fit_steps("zero1", 2 * k, steps, width, depth, batch, dev, 0.0, rate, skip)
    wire_s = 0.8 * base["step_s"] / 2
    zero1 = _fit_steps("zero1", 2 * k, steps, width, depth, batch, dev, wire_s, rate, skip)
    acco = _fit_steps("acco", k, steps, width, depth, batch, dev, wire_s, rate, skip)
    acco_dry = _fit_steps("acco", k, steps, width, depth, batch, dev, 0.0, rate, skip)
    ratio = acco["step_s"] / base["step_s"]
    equal = acco["samples_per_step"] == zero1["samples_per_step"] == base["samples_per_step"]
    return {"ok": equal and acco["steps"] == zero1["steps"] == steps, "params": depth * (width * width + width),
            "micro_batches": {"acco": k, "zero1": 2 * k}, "wire_s_per_round": wire_s, "zero1_no_wire": base,
            "zero1": zero1, "acco": acco, "acco_no_wire": acco_dry, "acco_over_no_wire": ratio,
            # ACCO's own work (the estimate's optimizer step, two rounds' launches) apart from the wire
            "acco_no_wire_over_zero1_no_wire": acco_dry["step_s"] / base["step_s"],
            "wire_left_visible_s": acco["step_s"] - acco_dry["step_s"],
            "target": "acco step (wire on) <= 1.05 x zero1 step (no wire), at equal samples per step",
            "meets_target": ratio <= 1.05}


# ------------------------------------------------------------------------------ memory
MEMORY_MODES = {"zero1": dict(strategy="zero1"), "acco": dict(strategy="acco"),
                "acco_loco4": dict(strategy="acco", codec="loco4", group_size=128),
                "diloco": dict(strategy="diloco", inner_steps=2), "sparseloco": dict(strategy="sparseloco", inner_steps=2)}


def formula_bytes_per_param(name: str, params: int, world: int = 1, compute_bytes: int = 4) -> float:
    """The planner's bytes per parameter for ``name`` (engine/planner/memory.py: the formula the
    planner uses, with the step's proposal and the codec state), at world ``world``, one node."""
    from engine.planner.memory import memory_per_gpu
    from engine.planner.modes import Mode
    from engine.planner.shape import ModelShape
    from engine.planner.wire import Layout, WireSettings

    kw = MEMORY_MODES[name]
    mode = Mode(strategy=kw["strategy"], codec=kw.get("codec", "none"))
    shape = ModelShape(params=params, layers=1, hidden=1, vocab=1)
    return memory_per_gpu(mode, shape, Layout(nodes=world), WireSettings(compute_bytes=compute_bytes)).total / params


def memory(args) -> dict:
    """Bytes per parameter the engine holds after a few steps (``memory_allocated``, and the peak
    ``max_memory_allocated`` with the activations of a tiny batch) against the planner's formula."""
    from engine import Engine, EngineConfig

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    width, depth = (64, 2) if args.small else (2048, 12)
    rows, params = {}, 0
    for name, kw in MEMORY_MODES.items():
        base = _settled_allocated(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model = _mlp(width, depth).to(dev)
        params = sum(p.numel() for p in model.parameters())
        engine = Engine(model, EngineConfig(lr=1e-4, micro_batches=1, accumulation="fixed", max_steps=4, **kw), _mse)
        x = torch.randn(4, width, device=dev)
        steps = len(engine.fit(iter([(x, x)] * 16)))
        want = formula_bytes_per_param(name, params)
        row = {"steps": steps, "formula": want}
        if cuda:
            peak = (torch.cuda.max_memory_allocated() - base) / params
            workspaces = _cublas_workspace_bytes()
            held = (_settled_allocated(cuda) - base) / params
            row.update(bytes_per_param=held, peak_bytes_per_param=peak, ratio=held / want,
                       cublas_workspace_bytes=workspaces)
        rows[name] = row
        engine.close()
        del engine, model
    out = {"ok": all(r["steps"] == 4 for r in rows.values()), "params": params, "world": 1, "strategies": rows}
    if cuda:
        out["meets_target"] = all(0.9 <= r["ratio"] <= 1.1 for r in rows.values())
        out["target"] = "held bytes per parameter within 10% of the formula"
    return out


def _settled_allocated(cuda: bool) -> int:
    """``memory_allocated`` with the last engine collected (its threads hold cycles) and cuBLAS's
    per-stream workspaces dropped (32 MiB for each stream a matmul ran on, kept by the caching
    allocator: each engine's new streams add one, which is no memory of the engine's)."""
    if not cuda:
        return 0
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _cublas_workspace_bytes() -> int:
    """What cuBLAS's workspaces hold now (dropped and measured; the next matmul takes them again)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    return before - torch.cuda.memory_allocated()


# ------------------------------------------------------------------------------ model sharding
class _Blocks(torch.nn.Module):
    """A stack of square Linear blocks (FSDP2 units: ``layers``) and a frozen head."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, width, bias=False)
        self.head.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


SHARDING_MODES = {"zero1": dict(strategy="zero1"), "acco": dict(strategy="acco")}


def model_sharding(args) -> dict:
    """``EngineConfig(model_sharding="node")`` at world 1 (one node of one rank): FSDP2 on the
    compute stream beside the engine's comm stream, a few steps of a stack of blocks, the loss
    finite and falling; on CUDA the bytes per parameter held after the steps
    (``memory_allocated``) against the planner's formula for node sharding
    (engine/planner/sharded_bytes.py ``node_sharded_bytes``: held after a step, no round temporaries),
    and FSDP2's unsharded blocks freed (engine/runtime/memory_accounting.py ``fsdp_unsharded_bytes``)."""
    from engine import Engine, EngineConfig
    from engine.planner.sharded_bytes import node_sharded_bytes
    from engine.runtime.memory_accounting import fsdp_unsharded_bytes, held_bytes
    from engine.strategies.spec import resolve_step_copy

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    width, depth = (64, 3) if args.small else (1024, 8)
    rows = {}
    for name, kw in SHARDING_MODES.items():
        base = _settled_allocated(cuda)
        model = _Blocks(width, depth).to(dev)
        frozen = model.head.weight.numel()
        engine = Engine(model, EngineConfig(model_sharding="node", lr=1e-3, micro_batches=2, accumulation="fixed",
                                            max_steps=4, **kw), _mse)
        x = torch.randn(8, width, device=dev)
        history = engine.fit(iter([(x, x)] * 40))
        losses = [h["loss"] for h in history]
        local = engine.flat.padded
        want = node_sharded_bytes(local, nodes=1, overlap=engine.plan.overlap, kept_shards=int(name == "acco"),
                                  compute_bytes=engine.flat.dtype.itemsize, chunks=engine.comm.chunks,
                                  backend="nccl" if cuda else "gloo", frozen=frozen,
                                  step_copy=resolve_step_copy(engine.cfg.step_copy, cuda))
        want_held = sum(v for k, v in want.items() if k != "temporaries")
        row = {"steps": len(history), "losses": losses, "params": local,
               "formula_bytes_per_param": want_held / local,
               "accounted_bytes_per_param": sum(held_bytes(engine.model, engine.ctx, engine.strategy).values()) / local,
               "fsdp_unsharded_bytes": fsdp_unsharded_bytes(engine.model)}
        if cuda:
            workspaces = _cublas_workspace_bytes()
            held = (_settled_allocated(cuda) - base) / local
            row.update(bytes_per_param=held, ratio=held / row["formula_bytes_per_param"],
                       cublas_workspace_bytes=workspaces)
        rows[name] = row
        engine.close()
        del engine, model
    ok = all(r["steps"] == 4 and all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0]
             and r["fsdp_unsharded_bytes"] == 0 for r in rows.values())
    out = {"ok": ok, "available": True, "world": 1, "width": width, "blocks": depth, "strategies": rows}
    if cuda:
        out["meets_target"] = all(0.9 <= r["ratio"] <= 1.1 for r in rows.values())
        out["target"] = "held bytes per parameter within 10% of the node-sharded formula"
    return out


# ------------------------------------------------------------------------------ the GPU tests, the recipe
def _run(cmd: list[str], limit_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


GPU_TEST_FILES = ("tests/engine/test_gpu.py", "tests/engine/test_compiled_codecs.py")


def gpu_tests(args) -> dict:
    """The GPU-marked tests (GPU_TEST_FILES: the engine's CUDA path, the codecs compiled by
    Inductor into Triton against eager), their pass/fail/skip counts."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        proc = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                     f"--junitxml={xml}", *GPU_TEST_FILES], args.part_limit_s - 5)
        cases = []
        if os.path.exists(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                status = next((t for t in ("failure", "error", "skipped") if case.find(t) is not None), "passed")
                cases.append({"name": case.get("name"), "status": status})
    counts = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failure", "error", "skipped")}
    return {"ok": proc.returncode == 0 and counts["passed"] > 0, "returncode": proc.returncode, **counts,
            "cases": cases, "output_tail": proc.stdout[-3000:] + proc.stderr[-2000:]}


def finetune(args) -> dict:
    """The fine-tuning recipe (tiny GPT-2, README.md as its text) for 5 steps on the device."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = _run([sys.executable, "recipes/finetune.py", "--model", "tiny-gpt2", "--dataset",
                     str(ROOT / "README.md"), "--max-steps", "5", "--output-dir", os.path.join(tmp, "run"),
                     "--eval-batches", "1", "--seq-len", "128", "--micro-batch-size", "8"], args.part_limit_s - 5)
        metrics = Path(tmp, "run", "metrics.jsonl")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in rows if r.get("kind") == "train"]
    losses = [r["loss"] for r in train]
    ok = proc.returncode == 0 and len(train) == 5 and all(isinstance(v, float) and math.isfinite(v) for v in losses)
    return {"ok": ok, "returncode": proc.returncode, "steps": len(train), "losses": losses,
            "step_time_s": [r["time_s"] for r in train], "output_tail": proc.stdout[-2000:] + proc.stderr[-2000:]}
