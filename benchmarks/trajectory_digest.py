"""Trajectory digest: losses, grad norms, bytes and final parameters' sha256 of many configs at
fixed seeds (2 workers, flat; 4 workers as 2x2 nodes), to check a refactor is bit for bit."""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch

from engine import Engine, EngineConfig, GlobalBatches
from engine.parallel.local_group import spawn
from tests.tiny import flat_params, mse_loss, tiny_model, worker_stream

K, STEPS = 2, 9
MODES = {
    "zero1": {"strategy": "zero1"},
    "dpu": {"strategy": "dpu"},
    "acco": {"strategy": "acco"},
    "acco_loco4_int4": {"strategy": "acco", "codec": "loco4", "param_codec": "int4"},
    "acco_grow": {"strategy": "acco", "accumulation": "grow", "max_round_overhead": 0.0, "max_micro_batches": 2},
    "zero1_ef4": {"strategy": "zero1", "codec": "ef4"},
    "onebit": {"strategy": "onebit_adam", "onebit_warmup_steps": 3},
    "local_sgd": {"strategy": "local_sgd", "optimizer": "sgd", "momentum": 0.0},
    "diloco": {"strategy": "diloco", "inner_steps": 3},
    "diloco_ov": {"strategy": "diloco", "inner_steps": 3, "outer_overlap": True},
    "sparseloco": {"strategy": "sparseloco", "inner_steps": 3, "topk_chunk": 64},
    "zero1_global": {"strategy": "zero1", "global_micro_batches": 4, "micro_batches": 1, "_global": True},
    "acco_global": {"strategy": "acco", "global_micro_batches": 4, "micro_batches": 1, "_global": True},
}

def run(rank, world, kw):
    kw = dict(kw); glob = kw.pop("_global", False)
    base = {"micro_batches": K, "accumulation": "fixed", "max_steps": STEPS, "lr": 1e-2, "align": 8}
    base.update(kw)
    if glob: base.pop("accumulation")
    cfg = EngineConfig(**base)
    eng = Engine(tiny_model(0), cfg, mse_loss)
    data = GlobalBatches(worker_stream(0, 4 * K * (STEPS + 4))) if glob else worker_stream(rank, K * (STEPS + 4) * 2)
    h = eng.fit(data)
    p = flat_params(eng.model)
    eng.close()
    keep = [(e["step"], e["loss"], e.get("grad_norm"), e["wire_bytes"], e["samples"], e["micro_batches"]) for e in h]
    return {"hist": repr(keep), "params": hashlib.sha256(p.numpy().tobytes()).hexdigest()}

if __name__ == "__main__":
    out = {}
    for name, kw in MODES.items():
        if "grow" in name:
            continue  # timing-dependent batch: not bit-reproducible by design
        res = spawn(run, 2, kw)
        out[name] = [hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16] for r in res]
        print(name, out[name], flush=True)
    for name in ("zero1", "acco_loco4_int4", "onebit"):
        res = spawn(run, 4, MODES[name], env={"LOCAL_WORLD_SIZE": "2"})
        out[name + "@2x2"] = [hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16] for r in res]
        print(name + "@2x2", out[name + "@2x2"], flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
