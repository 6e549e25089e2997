"""optimizer_offload='cpu' on this machine's device (a GPU when there is one): what the planner
assumes about it, measured, and the offloaded run against the run without it.

    python -m benchmarks.offload_check                 # the model's device: CUDA when present
    python -m benchmarks.offload_check --json out.json

Measures (1) the host <-> device copy rates of pinned fp32 buffers (one GPU alone: the planner
assumes 25 GB/s per direction with two GPUs sharing a PCIe Gen5 x16 link, engine/planner/timeline.py
``HostLink``), (2) the host step's rate, values per second, of the shard optimizer's step on the CPU
(the fused kernel where it builds, and torch's ops), and (3) world-1 runs of zero1 and
acco+loco4+int4 on a small MLP with and without offload: the largest relative difference of the
parameters after each step (on a GPU the offloaded step runs on the CPU, the other on the GPU: equal
up to float rounding; on a CPU the same bits) and seconds per step."""

from __future__ import annotations

import argparse
import json
import time

import torch

from acco_loco.optim import OptimizerSpec, can_fuse, init_state, propose_slice
from engine import Engine, EngineConfig
from engine.runtime.offload import ask_for_cpu_kernels, host_empty, pin_host

WIDTH, LAYERS, STEPS = 1024, 4, 6


def copy_rates(device: torch.device, values: int = 1 << 26) -> dict:
    host, dev = host_empty(values, pin_host()), torch.empty(values, device=device)
    host.normal_()
    out = {}
    for name, dst, src in (("to_device_GBps", dev, host), ("to_host_GBps", host, dev)):
        dst.copy_(src, non_blocking=True)  # warm
        best = float("inf")
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out[name] = 4 * values / best / 1e9
    return out


def host_step_rates(values: int = 1 << 24) -> dict:
    ask_for_cpu_kernels()
    spec = OptimizerSpec(name="adamw", betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    state, grad, scratch = init_state(torch.randn(values), spec), torch.randn(values), torch.empty(values)
    out_state = state.spare()
    out = {}
    for fused in (True, False):
        if fused and not can_fuse(spec, grad, state, out_state):
            out["fused_values_per_s"] = None
            continue
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            propose_slice(state, grad, 4, 1.0, 1e-3, spec, out_state, 0, values, scratch, fused)
            best = min(best, time.perf_counter() - t)
        out["fused_values_per_s" if fused else "torch_values_per_s"] = values / best
    return out


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).to(device)


def runs(device: torch.device) -> dict:
    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, WIDTH, generator=g).to(device), torch.randn(16, WIDTH, generator=g).to(device))
            for _ in range(2 * STEPS + 2)]
    out = {}
    for name, kw in (("zero1", dict(strategy="zero1")),
                     ("acco+loco4+int4", dict(strategy="acco", codec="loco4", param_codec="int4"))):
        snaps, seconds = {}, {}
        for offload in ("none", "cpu"):
            cfg = EngineConfig(lr=1e-3, micro_batches=1, accumulation="fixed", max_steps=STEPS,
                               optimizer_offload=offload, **kw)
            engine = Engine(_model(device), cfg, loss)
            it, snaps[offload] = iter(data), []
            engine.fit(it, steps=1)  # warm
            t = time.perf_counter()
            for _ in range(STEPS - 1):
                engine.fit(it, steps=1)
                snaps[offload].append(torch.nn.utils.parameters_to_vector(engine.model.parameters()).detach().cpu())
            seconds[offload] = (time.perf_counter() - t) / (STEPS - 1)
            engine.close()
        rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(snaps["cpu"], snaps["none"]))
        out[name] = {"max_rel_diff": rel, "bit_identical": rel == 0.0,
                     "s_per_step": seconds["none"], "s_per_step_offloaded": seconds["cpu"]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "copies": copy_rates(device), "host_step": host_step_rates(), "runs": runs(device)}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
