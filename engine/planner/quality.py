"""Reading the benchmark JSONs of a results folder: which planner mode a benchmark row ran, whether
it was scored on DDP's held-out sequences, and the samples a run needs to reach DDP's loss.
engine/planner/evidence.py turns them into the figures the planner and ``strategy="auto"`` use.

The figures come from the folder the caller names (``python -m engine.plan --results``, by default
./docs/results), never from the source tree: an installed engine has none.

The samples factor of one run (docs/planning.md, "Samples to AdamW's loss"), per seed against
that seed's torch DDP run: where the mode reaches DDP's final held-out loss, the samples at which
it does (linear between eval points) over the samples at which DDP did; where it does not, its
whole budget over the samples at which DDP had the mode's final loss (what the mode's run was
worth in AdamW's samples). Both read 1.0 for a mode that tracks AdamW's curve, and neither
counts a seed that lands 0.01% short of DDP's last point as never arriving."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from .modes import Mode

# The benchmark's mode names (benchmarks/modes.py MODES): the strategy (dashes for underscores),
# -h<H> and +overlap for a local-step strategy, then +<gradient codec>, +int8 or +int4params for int8
# or int4 parameter deltas (a LoCo codec's name alone means int8 deltas, another codec's alone full
# precision); @flat / @two_level the exchange. Other names (torch DDP's variants,
# ACCO's delay corrections, equal shares) are not planner modes.
BENCH_NAME = re.compile(r"(?P<strategy>[a-z0-9]+(?:-[a-z]+)*)(?:-h(?P<h>\d+)(?P<overlap>\+overlap)?)?"
                        r"(?:\+(?P<codec>[a-z]+\d+)(?P<deltas>\+int4params|\+int8)?)?(?:@(?P<exchange>flat|two_level))?")
EXCHANGES = {"flat": "flat", "two_level": "two-level"}  # the benchmark's @suffix -> Mode.exchange


def bench_mode(name: str) -> Mode | None:
    """The planner's Mode a benchmark row ran, or None for a benchmark mode the planner does not
    price."""
    from engine.strategies import STRATEGIES, strategy_class

    m = BENCH_NAME.fullmatch(name)
    strategy = m and m["strategy"].replace("-", "_")
    if not m or strategy not in STRATEGIES or strategy_class(strategy).spec() is None:
        return None
    spec = strategy_class(strategy).spec()
    if spec.local_steps != (m["h"] is not None) or (m["codec"] and not spec.codec_variants):
        return None
    fields = {"exchange": EXCHANGES[m["exchange"] or "flat"]}
    if m["h"]:
        fields.update(inner_steps=int(m["h"]), outer_overlap=bool(m["overlap"]))
    if m["codec"]:
        implied = "int8" if implies_int8_deltas(m["codec"]) else "auto"
        deltas = {"+int4params": "int4", "+int8": "int8"}.get(m["deltas"] or "", implied)
        fields.update(codec=m["codec"], param_codec=deltas)
    return Mode(strategy, **fields)


def bench_name(mode: Mode) -> str | None:
    """The benchmark's name for ``mode`` on the flat exchange (as the 2x1 testbed runs it), or
    None where the benchmark has no such mode (LoCo-4 gradients with full-precision parameters,
    low-bit parameter deltas without a gradient codec)."""
    if mode.is_ddp:
        return "torch-ddp"
    deltas = mode.param_codec if mode.param_codec in ("int8", "int4") else "auto"
    if (mode.codec == "none" and deltas != "auto") or (implies_int8_deltas(mode.codec) and deltas == "auto"):
        return None
    name = mode.strategy.replace("_", "-")
    if mode.local_steps:
        name += f"-h{mode.inner_steps}" + ("+overlap" if mode.outer_overlap else "")
    if mode.codec != "none":
        implied = "int8" if implies_int8_deltas(mode.codec) else "auto"
        name += f"+{mode.codec}" + ("" if deltas == implied else "+int4params" if deltas == "int4" else "+int8")
    return name


def implies_int8_deltas(codec: str) -> bool:
    """A LoCo codec: the benchmark's name of it alone means int8 parameter deltas (benchmarks/modes.py)."""
    return codec.startswith("loco")


@lru_cache(maxsize=None)  # the JSONs do not change under a process
def results_doc(results: Path | None, name: str) -> dict | None:
    """A benchmark JSON of the ``results`` folder (the repository's docs/results), parsed; None
    when there is no folder or no such file. Read-only."""
    if results is None:
        return None
    path = Path(results) / name
    return json.loads(path.read_text()) if path.exists() else None


def scored_like_ddp(doc: dict, row: dict) -> bool:
    """Whether ``row``'s held-out loss is on DDP's held-out sequences: JSONs made before the
    benchmark fixed the eval batches (no ``eval_micro_batch`` in their config) scored each mode on
    batches of its own micro-batch, so a row at another micro-batch than the command's (ACCO's
    half) saw a different set (docs/results.md, the held-out correction)."""
    cfg = doc.get("config", {})
    return "eval_micro_batch" in cfg or row.get("micro_batch") in (None, cfg.get("micro_batch"))


def first_crossing(evals: list[dict], target: float, key: str = "samples") -> float | None:
    """``key`` (samples, time_s) at which the held-out loss first reaches ``target``, linear
    between eval points; None when it never does."""
    prev = None
    for e in evals:
        if e.get("loss") is None:
            continue
        if e["loss"] <= target:
            if prev is None or prev["loss"] == e["loss"]:
                return e[key]
            f = (prev["loss"] - target) / (prev["loss"] - e["loss"])
            return prev[key] + f * (e[key] - prev[key])
        prev = e
    return None


def run_factor(run: dict, ddp_run: dict) -> tuple[float, str] | None:
    """(samples factor, how) of one seed's run against the same seed's DDP run (see the module)."""
    if run.get("final_loss") is None or ddp_run.get("final_loss") is None:
        return None
    own = first_crossing(ddp_run["evals"], ddp_run["final_loss"])
    reached = first_crossing(run["evals"], ddp_run["final_loss"])
    if reached is not None and own:
        return reached / own, "reached"
    worth = first_crossing(ddp_run["evals"], run["final_loss"])
    budget = max((e["samples"] for e in run["evals"] if e.get("loss") is not None), default=None)
    if worth and budget:
        return budget / worth, "equivalent"
    return None
