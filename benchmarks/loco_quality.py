"""LoCo quality check: does 4-bit compensated communication train as well as fp32 ZeRO-1?

Trains a randomly initialised GPT-2-shaped model (``lm.models.tiny_gpt2``, byte vocabulary)
on the shipped Shakespeare plays (Hamlet held out) at world size 2 in real gloo process groups,
once per mode, with the same seed, data order, learning rate and schedule:

* ``zero1``          strategy zero1, codec none, fp32 params (the reference)
* ``acco``           strategy acco, uncompressed (optional)
* ``acco+loco4+int8`` strategy acco, LoCo 4-bit gradients, int8 parameter deltas
* ``acco+int4+int8``  strategy acco, plain 4-bit gradients (no compensation), int8 parameter deltas

and prints a markdown table: final train loss (mean over the last 10% of steps) and its ratio to
zero1's, held-out loss at the end, wire bytes per optimizer step (sent by one worker) and its
ratio to zero1's. Every mode runs ``--micro-batches`` per round, and an acco step is two rounds,
so at one setting acco takes twice zero1's samples per step (the table's samples/step column): for
an equal batch run acco alone at half zero1's ``--micro-batches``.

    nice -n 19 python benchmarks/loco_quality.py --steps 300 --json loco_quality.json
    python benchmarks/loco_quality.py --steps 40 --n-layer 2 --n-embd 128 --modes zero1 acco+loco4+int8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.modes import QUALITY_MODES, engine_modes  # noqa: E402

# mode name -> EngineConfig overrides (from the one mode table, benchmarks/modes.py)
MODES: dict[str, dict] = engine_modes(QUALITY_MODES)
DEFAULT_MODES = ("zero1", "acco+loco4+int8", "acco+int4+int8", "acco")


@dataclass
class QualityConfig:
    steps: int = 300
    world: int = 2
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    seq_len: int = 128
    micro_batch_size: int = 8
    micro_batches: int = 2
    lr: float = 1e-3
    warmup_steps: int = 20
    seed: int = 0
    group_size: int = 128
    eval_batches: int = 16  # held-out micro-batches (of micro_batch_size x seq_len) evaluated at the end
    heldout: str = "hamlet"
    optimizer: str = "adamw"  # "muon": Muon for the hidden matrices, AdamW for the rest (EngineConfig)
    max_grad_norm: float | None = None  # clip the global gradient norm (None: no clipping)
    extra: dict = field(default_factory=dict)  # further EngineConfig overrides for every mode


def _worker(rank: int, world: int, qc_dict: dict, overrides: dict) -> dict:

    from engine import Engine, EngineConfig
    from lm.data import (
        ByteTokenizer,
        TokenBatches,
        eval_batches,
        eval_loss,
        hf_lm_loss,
        load_text_documents,
        split_heldout,
        tokenize_documents,
    )
    from lm.models import tiny_gpt2

    qc = QualityConfig(**qc_dict)
    tok = ByteTokenizer()
    train_docs, held_docs = split_heldout(load_text_documents(None), qc.heldout)
    train_tokens = tokenize_documents(train_docs, tok)
    held_tokens = tokenize_documents(held_docs, tok)
    model = tiny_gpt2(vocab_size=len(tok), n_layer=qc.n_layer, n_embd=qc.n_embd, n_head=qc.n_head,
                      n_positions=qc.seq_len + 1, seed=qc.seed)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = EngineConfig(**{
        "micro_batches": qc.micro_batches, "accumulation": "fixed", "max_steps": qc.steps,
        "optimizer": qc.optimizer, "lr": qc.lr, "max_grad_norm": qc.max_grad_norm, "lr_schedule": "constant", "warmup_steps": qc.warmup_steps,
        "seed": qc.seed, "group_size": qc.group_size, "compute_dtype": "float32",
        **qc.extra, **overrides})
    batches = TokenBatches(train_tokens, qc.seq_len, qc.micro_batch_size, rank=rank, world_size=world,
                           seed=qc.seed)
    engine = Engine(model, cfg, loss_fn=hf_lm_loss)
    t0 = time.perf_counter()
    try:
        history = engine.fit(batches.iter_from(0))
    finally:
        engine.close()
    train_s = time.perf_counter() - t0
    held = None
    if rank == 0:
        held = eval_loss(model, eval_batches(held_tokens, qc.seq_len, qc.micro_batch_size,
                                             max_batches=qc.eval_batches)).loss
    return {"history": history, "heldout_loss": held, "train_s": train_s, "n_params": n_params,
            "consumed": engine.consumed}


def run_mode(mode: str, qc: QualityConfig, timeout: float | None = None) -> dict:
    """Train one mode at qc.world ranks; summary dict (rank 0's view, wire bytes of rank 0)."""
    from engine.parallel.local_group import spawn

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose from {sorted(MODES)}")
    t0 = time.perf_counter()
    results = spawn(_worker, qc.world, asdict(qc), MODES[mode],
                    timeout=timeout if timeout is not None else max(600.0, 20.0 * qc.steps))
    wall = time.perf_counter() - t0
    r0 = results[0]
    hist = r0["history"]
    losses = [h["loss"] for h in hist]
    tail = max(1, len(losses) // 10)
    wire = [h["wire_bytes"] for h in hist]
    return {
        "mode": mode,
        "steps": len(hist),
        "final_train_loss": sum(losses[-tail:]) / tail,
        "heldout_loss": r0["heldout_loss"],
        "wire_bytes_per_step": sum(wire) / len(wire),
        "samples_per_step": sum(h["samples"] for h in hist) / len(hist),
        "micro_batches_per_step": sum(h["global_micro_batches"] for h in hist) / len(hist),
        "n_params": r0["n_params"],
        "train_s": max(r["train_s"] for r in results),
        "wall_s": wall,
        "losses": losses,
    }


def compare(modes, qc: QualityConfig, log=print) -> dict[str, dict]:
    out = {}
    for mode in modes:
        log(f"[loco_quality] {mode}: {qc.steps} steps ...")
        out[mode] = run_mode(mode, qc)
        r = out[mode]
        log(f"[loco_quality] {mode}: final train {r['final_train_loss']:.4f}, held-out "
            f"{r['heldout_loss']:.4f}, {r['wire_bytes_per_step'] / 1e6:.2f} MB/step, {r['wall_s']:.0f} s")
    return out


def markdown_table(results: dict[str, dict], reference: str = "zero1") -> str:
    ref = results.get(reference)
    lines = ["| mode | steps | final train loss (last 10%) | ratio to zero1 | held-out loss (Hamlet) "
             "| wire bytes/step (one worker) | ratio to zero1 | samples/step | train s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        lr = f"{r['final_train_loss'] / ref['final_train_loss']:.4f}" if ref else "-"
        wr = f"{r['wire_bytes_per_step'] / ref['wire_bytes_per_step']:.3f}" if ref else "-"
        lines.append(f"| {mode} | {r['steps']} | {r['final_train_loss']:.4f} | {lr} | {r['heldout_loss']:.4f} "
                     f"| {r['wire_bytes_per_step']:,.0f} | {wr} | {r['samples_per_step']:.0f} | {r['train_s']:.0f} |")
    return "\n".join(lines)


def engine_overrides(pairs: list[str]) -> dict:
    """``KEY=VALUE`` strings as EngineConfig fields; VALUE read as JSON where it parses (numbers,
    true/false), else kept as a string. An unknown field is refused here, before any worker starts."""
    from engine.config import describe_settings

    fields, out = describe_settings(), {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {pair!r}: write KEY=VALUE, e.g. --set muon_momentum=0.98")
        if key not in fields:
            raise SystemExit(f"--set {pair!r}: EngineConfig has no field {key!r} "
                             "(engine/config.py and its sections list them)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=sorted(MODES))
    p.add_argument("--json", default=None, help="write the results (with per-step losses) here")
    p.add_argument("--n-layer", type=int, default=QualityConfig.n_layer)
    p.add_argument("--n-embd", type=int, default=QualityConfig.n_embd)
    p.add_argument("--n-head", type=int, default=QualityConfig.n_head)
    p.add_argument("--seq-len", type=int, default=QualityConfig.seq_len)
    p.add_argument("--micro-batch-size", type=int, default=QualityConfig.micro_batch_size)
    p.add_argument("--micro-batches", type=int, default=QualityConfig.micro_batches)
    p.add_argument("--lr", type=float, default=QualityConfig.lr)
    p.add_argument("--warmup-steps", type=int, default=QualityConfig.warmup_steps)
    p.add_argument("--eval-batches", type=int, default=QualityConfig.eval_batches)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=("adamw", "muon"), default=QualityConfig.optimizer)
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm (default: none)")
    p.add_argument("--codecs", nargs="*", default=[], metavar="CODEC",
                   help="also run zero1 with each of these gradient codecs and int8 parameter deltas, named "
                        "zero1+CODEC (e.g. loco4 ef4 int4: LoCo's moving-average error, classic error feedback, "
                        "none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for every mode, e.g. muon_momentum=0.98 (repeatable)")
    a = p.parse_args(argv)
    for c in a.codecs:
        MODES[f"zero1+{c}"] = {"strategy": "zero1", "codec": c, "param_codec": "int8"}
        a.modes.append(f"zero1+{c}")
    qc = QualityConfig(steps=a.steps, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, seq_len=a.seq_len,
                       micro_batch_size=a.micro_batch_size, micro_batches=a.micro_batches, lr=a.lr,
                       warmup_steps=a.warmup_steps, eval_batches=a.eval_batches, seed=a.seed,
                       optimizer=a.optimizer, max_grad_norm=a.max_grad_norm, extra=engine_overrides(a.set))
    modes = list(dict.fromkeys(a.modes))
    if "zero1" in modes:  # the reference first
        modes.remove("zero1")
        modes.insert(0, "zero1")
    t0 = time.perf_counter()
    results = compare(modes, qc, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"\n{qc}\n")
    print(markdown_table(results))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": asdict(qc), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
