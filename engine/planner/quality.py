"""Loss per sample against synchronous AdamW (torch DDP), from the project's own measurements.

Each figure is a benchmark JSON's ``loss_vs_ref_pct``: the held-out loss at equal samples
against torch DDP's (AdamW, the same lr sweep and data order), median over the seeds both ran
(recipes/benchmark.py, docs/DESIGN.md section 4.3). Caveats, which travel with every figure: a
4.87M-parameter GPT-2 on byte-level Shakespeare, 2 or 3 workers, 768-3072 samples (a few hundred
steps at most), 1-3 seeds; runs of one mode differ by a few tenths of a percent between seeds.
They say whether a mode keeps AdamW's loss per sample at that scale, not what it does at 1B-70B.
zero1 is AdamW itself (the same update, float32 summation order aside); dpu has no matched-batch
measurement (its one-step-stale update is not AdamW's)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from .modes import Mode
from .validate import RESULTS

QUALITY_FILES = ("bench_20mbit_b16_seeds3.json", "bench_100mbit_b16_3seeds.json", "bench_100mbit_b16_s0_local.json",
                 "bench_100mbit_b64_3seeds.json", "bench_1gbit_b16_3seeds.json", "bench_1gbit_b16_loss_3seeds.json",
                 "bench_hetero_b96_3seeds.json")
CAVEAT = ("4.87M GPT-2, byte-level Shakespeare, 2-3 workers, 768-3072 samples, 1-3 seeds; held-out loss at "
          "equal samples vs torch DDP (AdamW)")


@dataclass(frozen=True)
class Quality:
    loss_vs_adamw_pct: float | None  # median over the sources; + = worse
    sources: tuple[str, ...]  # "file: +x.x% (n seeds)"
    note: str = ""


def bench_name(mode: Mode) -> str | None:
    """The benchmark's name for the measured counterpart of ``mode`` (the exchange does not change
    the update up to where the compression applies; two-level has no measurement yet)."""
    if mode.is_ddp:
        return "torch-ddp"
    if mode.strategy == "onebit_adam":
        return "onebit-adam"
    if mode.local_steps:
        return f"{mode.strategy}-h{mode.inner_steps}" + ("+overlap" if mode.outer_overlap else "")
    name = mode.strategy + ("" if mode.codec == "none" else f"+{mode.codec}")
    return name + (f"+{mode.param_codec}params" if mode.param_codec in ("int8", "int4") else "")


def quality(mode: Mode, files=QUALITY_FILES) -> Quality:
    name = bench_name(mode)
    found, sources, seen = [], [], set()
    for f in files:
        path = RESULTS / f
        if not path.exists():
            continue
        for o in json.loads(path.read_text())["modes"]:
            key = (o.get("loss_vs_ref_pct"), o.get("loss_vs_ref_samples"))
            if o["mode"] == name and key[0] is not None and key not in seen:  # merged JSONs repeat runs
                seen.add(key)
                found.append(o["loss_vs_ref_pct"])
                sources.append(f"{f}: {o['loss_vs_ref_pct']:+.2f}% ({len(o.get('seeds', []))} seeds, "
                               f"{o.get('loss_vs_ref_samples'):.0f} samples)")
    if mode.is_ddp and mode.ddp_dtype == "float32":
        return Quality(0.0, ("the reference",))
    if found:
        return Quality(statistics.median(found), tuple(sources))
    if mode.is_ddp:  # a bf16 all-reduce of the gradients: AdamW with bf16-rounded gradients
        return Quality(None, (), "bf16 gradient all-reduce: not measured here")
    if mode.strategy in ("zero1", "acco") and (mode.codec, mode.param_codec) != ("none", "auto"):
        # the same codecs and error feedback as the measured acco+loco4+int4params, or a subset of
        # them (int8 deltas and full-precision parameters lose less than int4 deltas)
        base = quality(Mode("acco", "loco4", "int4"), files)
        if base.loss_vs_adamw_pct is not None and mode.codec in ("none", "loco4"):
            return Quality(base.loss_vs_adamw_pct, base.sources,
                           "inferred from acco+loco4+int4params (the same or fewer lossy codecs)")
    if mode.strategy == "dpu":
        return Quality(None, (), "not measured at a matched batch (a one-step-stale update, not AdamW's)")
    return Quality(None, (), "not measured at a matched batch")
