"""The first run on ONE GPU (docs/gpu.md): what one H100 or H200 must show.

    python benchmarks/gpu_check.py --json docs/results/gpu_check_<gpu>.json

Each part runs in its own process with a time limit (a hang or a sticky CUDA error costs that
part only), the JSON is rewritten after every part, and the whole stays under 8 minutes
(``--budget-s``; a part gets what is left of it, at most its own limit). The parts
(benchmarks/gpu_parts.py):

1. ``nccl_world1``: NCCL at world 1 with the world-1 shortcut off (the collectives called from
   the engine's comm thread on its stream, as async works), then the abort;
2. ``gloo_pair``: two processes sharing the GPU over a gloo group: CUDA compute, the comm stream,
   the multi-rank compressed path (ACCO, loco4, int8 parameters), replicas bit-identical;
3. ``sync_debug``: whole fits under ``torch.cuda.set_sync_debug_mode("warn")``: syncs per step;
4. ``codecs``: codec bits on the GPU equal to the CPU's; the engine's encode + error feedback,
   eager and compiled (acco_loco/compiled.py), GB/s against a device copy;
5. ``overlap``: ACCO against zero1 at equal samples per step (an ACCO step is two rounds of k
   micro-batches, zero1's one of 2k), the wire emulated by ``torch.cuda._sleep`` on the comm stream;
6. ``memory``: bytes per parameter from ``memory_allocated`` against the planner's formula
   (engine/planner/memory.py);
7. ``model_sharding``: ``EngineConfig(model_sharding="node")`` at world 1: FSDP2 beside the
   engine's streams, a few steps of zero1 and acco, bytes per parameter against the formula;
8. ``finetune``: the recipe on the GPU for 5 steps; 9. ``gpu_tests``: the GPU-marked tests (the
   engine's CUDA path; the codecs compiled into Triton against eager);
10. ``replicas``, ``muon``, ``local_sharded`` (benchmarks/gpu_parts_replicas.py): every strategy's
   replicas bit for bit at 2 processes; optimizer="muon" against its float64 reference;
   node-sharded diloco and sparseloco at 1 node x 2 ranks against the unsharded run, and memory;
11. ``offload``, ``slice_load`` (benchmarks/gpu_parts_loading.py): optimizer_offload="cpu" against
   no offload, and the PCIe and host-step rates; loading by slices at 1 node x 2 ranks;
12. ``real_model`` (benchmarks/gpu_parts_model.py): SmolLM2-135M whole in bf16, 2 processes, acco +
   loco4 + int4 parameters against zero1 with a 1 Gbit/s wire emulated.

Without a CUDA device it exits with status 2 and writes nothing. ``--device cpu --small`` runs
the parts that can run on CPU (the tests' smoke run: the machinery and the calls into the engine;
its figures mean nothing). Exit status 1 if a part failed, 0 otherwise; targets are reported
(``meets_target``), not enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NO_CUDA = ("gpu_check: no CUDA device here (torch.cuda.is_available() is False). This check measures the "
           "GPU path and needs one NVIDIA GPU with a CUDA build of PyTorch; on CPU run the test suite instead "
           "(or --device cpu --small: a smoke run of this script).")
BUDGET_S = 480.0  # the whole run: 8 minutes, what a GPU session can give it (the parts' limits add up to it)


@dataclass(frozen=True)
class Part:
    name: str
    limit_s: float  # its own time limit (a process killed past it)
    cuda_only: bool = False  # nothing to run on CPU
    module: str = "gpu_parts"  # the file under benchmarks/ that defines it


# limits: about 1.3x each old part's time in the H200 run (docs/results/gpu_check_h200.json; the
# codecs' 46 s there, more) and each new part's estimate; together 480 s, the budget, so no part is
# cut short by the others
PARTS = [Part("nccl_world1", 10, cuda_only=True), Part("gloo_pair", 36), Part("sync_debug", 30),
         Part("codecs", 56), Part("overlap", 16), Part("memory", 32), Part("model_sharding", 14),
         Part("finetune", 24), Part("gpu_tests", 20, cuda_only=True),
         # issue 45's, prepared on CPU (docs/gpu.md "Prepared, not yet run on a GPU")
         Part("replicas", 36, module="gpu_parts_replicas"), Part("muon", 24, module="gpu_parts_replicas"),
         Part("local_sharded", 28, module="gpu_parts_replicas"), Part("offload", 24, module="gpu_parts_loading"),
         Part("slice_load", 26, module="gpu_parts_loading"), Part("real_model", 104, module="gpu_parts_model")]
BY_NAME = {p.name: p for p in PARTS}


# ------------------------------------------------------------------------------ running a part
def run_command(cmd: list[str], limit_s: float, result: Path) -> dict:
    """Run ``cmd`` (it writes its dict as JSON to ``result``) in its own process group; kill the
    group past ``limit_s``. A hang, a crash or a missing result is a failed part, never an exception."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        output, _ = proc.communicate(timeout=limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it spawned
        output, _ = proc.communicate()
        timed_out = True
    took = time.monotonic() - t0
    if timed_out:
        out = {"ok": False, "error": f"timed out after {limit_s:.0f} s (killed)"}
    elif result.exists():
        try:
            out = json.loads(result.read_text())
        except ValueError as exc:
            out = {"ok": False, "error": f"unreadable result: {exc}"}
    else:
        out = {"ok": False, "error": f"exit status {proc.returncode} without a result"}
    out["part_s"] = took
    if not out.get("ok"):
        out["output_tail"] = (output or "")[-4000:]
    return out


def part_command(name: str, args, result: Path, limit_s: float) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-part", name, "--result", str(result),
           "--device", args.device, "--repeats", str(args.repeats), "--codec-log2", str(args.codec_log2),
           "--part-limit-s", str(limit_s), "--json", str(result)]
    return cmd + (["--small"] if args.small else []) + ([] if args.compile else ["--no-compile"])


def write_json(path: Path, report: dict) -> None:
    """Atomically: a reader (or a killed run) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def run_parts(steps: list[tuple[str, float, object]], json_path: Path, report: dict, budget_s: float) -> bool:
    """``steps``: (name, limit_s, make_cmd(result_path, limit_s) -> argv). Each within what is left
    of ``budget_s``; the report is written after each. Returns whether every part that ran passed."""
    start, ok = time.monotonic(), True
    report.setdefault("parts", {})
    for name, limit_s, make_cmd in steps:
        left = budget_s - (time.monotonic() - start)
        if left < 10:
            report["parts"][name] = {"ok": False, "error": f"not run: the {budget_s:.0f} s budget was spent"}
        else:
            limit = min(limit_s, left)
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "part.json"
                report["parts"][name] = run_command(make_cmd(result, limit), limit, result)
        part = report["parts"][name]
        ok &= bool(part.get("ok"))
        report["total_s"] = time.monotonic() - start
        write_json(json_path, report)
        status = "ok" if part.get("ok") else "FAILED"
        extra = f" meets target: {part['meets_target']}" if "meets_target" in part else ""
        print(f"{name}: {status} ({part.get('part_s', 0):.0f} s){extra}" + (f" {part['error']}" if "error" in part else ""),
              flush=True)
    return ok


# ------------------------------------------------------------------------------ inside a part's process
def run_one(args) -> int:
    import importlib

    try:
        module = importlib.import_module(f"benchmarks.{BY_NAME[args.run_part].module}")
        out = getattr(module, args.run_part)(args)
    except Exception as exc:  # the part's error, in its result
        import traceback

        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    Path(args.result).write_text(json.dumps(out, default=str))
    return 0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--parts", nargs="+", default=[p.name for p in PARTS], choices=list(BY_NAME))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--codec-log2", type=int, default=26, help="values per codec buffer, log2 (26: 256 MB fp32)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's time")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of the parts that can run there (the tests use it); its numbers mean nothing")
    ap.add_argument("--small", action="store_true", help="tiny sizes (with --device cpu: the smoke run)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled codecs")
    ap.add_argument("--limit-scale", type=float, default=1.0,
                    help="multiply every part's time limit (the CPU smoke run on a loaded machine); 1 on a GPU")
    ap.add_argument("--run-part", help=argparse.SUPPRESS)  # inside a part's own process
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--part-limit-s", type=float, default=60.0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.run_part:
        return run_one(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (smoke run: no figures)",
              "gpus": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "parts": {}}
    for name in args.parts:
        if BY_NAME[name].cuda_only and not cuda:
            report["parts"][name] = {"ok": True, "skipped": "needs CUDA"}
    steps = [(name, BY_NAME[name].limit_s * args.limit_scale, lambda result, limit, name=name: part_command(name, args, result, limit))
             for name in args.parts if name not in report["parts"]]
    ok = run_parts(steps, Path(args.json), report, args.budget_s)
    write_json(Path(args.json), report)
    print(f"wrote {args.json} ({report.get('total_s', 0):.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
