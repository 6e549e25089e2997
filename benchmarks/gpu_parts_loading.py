"""Parts of benchmarks/gpu_check.py for the state and the model (issue 45): ``offload``
(optimizer_offload="cpu" against the run without it, and the host step's and the PCIe copies'
rates) and ``slice_load`` (the recipe's loading by slices at 1 node x 2 ranks: what a rank holds
while loading). Each is ``part(args) -> dict`` with ``ok``; with ``--device cpu`` they run at tiny
sizes (the tests' smoke run: the figures mean nothing)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_parts import _mlp, _mse
from benchmarks.gpu_parts_replicas import _gloo, _peak_reset, _peak_since, device_of, random_stream

# ------------------------------------------------------------------------------ offloaded optimizer state
OFFLOAD_STEPS = 5
OFFLOAD_MODES = {"acco+loco4+int4params": dict(strategy="acco", codec="loco4", param_codec="int4"),
                 "diloco": dict(strategy="diloco", inner_steps=2)}


def _offload_run(kw: dict, offload: str, device: torch.device, width: int, depth: int) -> tuple[list, float]:
    """The parameters after each step and the median seconds per step (the first step apart)."""
    from engine import Engine, EngineConfig

    cfg = EngineConfig(lr=1e-3, micro_batches=1, accumulation="fixed", max_steps=OFFLOAD_STEPS,
                       optimizer_offload=offload, **kw)
    engine = Engine(_mlp(width, depth).to(device), cfg, _mse)
    batches, snaps, seconds = iter(random_stream(0, 2 * OFFLOAD_STEPS + 4, width, width)), [], []
    for _ in range(OFFLOAD_STEPS):
        t = time.perf_counter()
        engine.fit(batches, steps=1)
        snaps.append(torch.nn.utils.parameters_to_vector(engine.model.parameters()).detach().cpu())
        seconds.append(time.perf_counter() - t)
    engine.close()
    return snaps, sorted(seconds[1:])[len(seconds[1:]) // 2]


def offload(args) -> dict:
    """optimizer_offload="cpu" with acco + loco4 + int4 parameters and with diloco on the device:
    the parameters after every step against the run without offload (bits; on a GPU the offloaded
    step runs on the CPU and the other on the GPU, so the largest relative difference is reported
    too), and benchmarks/offload_check.py's rates: pinned host <-> device copies and the host step."""
    from benchmarks.offload_check import copy_rates, host_step_rates

    dev = device_of(args)
    width, depth = (32, 2) if args.small else (1024, 4)
    rows = {}
    for name, kw in OFFLOAD_MODES.items():
        plain, plain_s = _offload_run(kw, "none", dev, width, depth)
        moved, moved_s = _offload_run(kw, "cpu", dev, width, depth)
        rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(moved, plain))
        rows[name] = {"bit_identical": all(torch.equal(a, b) for a, b in zip(moved, plain)), "max_rel_diff": rel,
                      "steps": len(moved), "s_per_step": plain_s, "s_per_step_offloaded": moved_s}
    out = {"ok": all(r["steps"] == OFFLOAD_STEPS and r["max_rel_diff"] < 1e-4 for r in rows.values()),
           "params": sum(p.numel() for p in _mlp(width, depth).parameters()), "modes": rows,
           "copies": copy_rates(dev, 1 << (16 if args.small else 26)),
           "host_step": host_step_rates(1 << (14 if args.small else 24)),
           "planner_assumes": "25 GB/s per direction (engine/planner/timeline.py HostLink)",
           "target": "the offloaded run's parameters bit for bit the run's without offload"}
    out["meets_target"] = all(r["bit_identical"] for r in rows.values())
    return out


# ------------------------------------------------------------------------------ loading by slices
def save_llama(folder: Path, small: bool) -> dict:
    """A random Llama saved by save_pretrained in several safetensors files; its sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, mlp, layers, vocab = (64, 160, 2, 257) if small else (512, 1536, 4, 8192)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=8 if not small else 4, num_key_value_heads=4 if not small else 2,
                         max_position_embeddings=512, tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="40KB" if small else "8MB")
    block = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head once
    files = len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))
    return {"hidden": hidden, "layers": layers, "vocab": vocab, "params": sum(p.numel() for p in model.parameters()),
            "model_bytes": total, "block_bytes": block, "files": files}


def _slice_worker(rank: int, world: int, device: str, folder: str, vocab: int) -> dict:
    from engine import Engine, EngineConfig
    from engine.core import loading

    _gloo()
    dev = torch.device(device)
    at_load = {}
    real = loading.load_local_shards

    def measured(model, plan, g, local):  # the device's peak while this rank reads its rows
        base = _peak_reset(dev)
        out = real(model, plan, g, local)
        at_load["peak_bytes"] = _peak_since(dev, base)
        return out
    loading.load_local_shards = measured
    cfg = EngineConfig(strategy="zero1", lr=1e-3, micro_batches=1, accumulation="fixed", max_steps=2,
                       model_sharding="node", timeout_s=60.0)
    engine = Engine.from_pretrained(folder, cfg, device=dev)
    g = torch.Generator().manual_seed(rank)
    batches = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, vocab, (2, 32), generator=g)
                                                              for _ in range(4))]
    losses = [h["loss"] for h in engine.fit(iter(batches))]
    weights = engine.weights
    engine.close()
    return {"held_bytes": weights.held_bytes, "largest_read": weights.largest_read, "bytes_read": weights.bytes_read,
            "peak_bytes_at_load": at_load.get("peak_bytes"), "losses": losses}


def slice_load(args) -> dict:
    """The recipe's loading by slices (docs/nodes.md, engine/checkpoint/slices.py) of a Llama saved
    on the fly, model_sharding="node" at 1 node x 2 ranks on the device: each rank allocates its
    FSDP2 local shards and reads their rows; what it holds while loading (its shards' storage + the
    largest read at once; on CUDA also ``max_memory_allocated`` around the load) <= 1/G of the model
    plus one block; then two steps."""
    from engine.parallel.local_group import spawn

    dev, g = device_of(args), 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        sizes = save_llama(folder, args.small)
        runs = spawn(_slice_worker, g, str(dev), str(folder), sizes["vocab"], timeout=args.part_limit_s,
                     env={"LOCAL_WORLD_SIZE": str(g)})
    bound = sizes["model_bytes"] / g + sizes["block_bytes"]
    ranks = []
    for rank, run in enumerate(runs):
        held = run["held_bytes"] + run["largest_read"]
        ranks.append({**run, "held_while_loading": held, "over_bound": held / bound})
    ok = all(r["held_while_loading"] <= bound and len(r["losses"]) == 2 for r in ranks)
    out = {"ok": ok, "layout": "1 node x 2 ranks on one device (gloo)", "model": sizes, "bound_bytes": bound,
           "ranks": ranks}
    if dev.type == "cuda":
        out["meets_target"] = all(r["peak_bytes_at_load"] <= bound for r in ranks)
        out["target"] = "max_memory_allocated while loading <= model / G + one block"
    return out
