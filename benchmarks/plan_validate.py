"""Predicted against measured on the CPU testbed, from the benchmark JSONs in docs/results.

Each row is predicted from the run's own compute-only pace (the JSON's
``compute_only_samples_per_s`` for the row's micro-batch, measured beside the run with no
communication), its link rate and its batch; never from its step time. The comm side's CPU is
the testbed profile's stated constants (engine/planner/hardware.py ``TESTBED_CONSTANTS``), which
``measure_constants`` recomputes from the same JSONs' thread CPU counters.

    python -m benchmarks.plan_validate            # the table of docs/planning.md, "Validation on the testbed"

It lives with the benchmarks, not in the planner: it names the benchmark's modes and reads the
repository's docs/results, which an installed engine does not have.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from engine.parallel.topology import Layout
from engine.planner.hardware import cpu_testbed
from engine.planner.modes import Mode
from engine.planner.shape import ModelShape
from engine.planner.timeline import Batch, step_time
from engine.planner.wire import WireSettings, step_bytes

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"  # the repository's benchmark JSONs

# every matched-batch JSON (one global batch per step for every mode, fixed micro-batches); the
# free-protocol JSONs (bench_r*.json) let the batch grow with the link's timing, so their step
# holds a timing-dependent batch and is left out
VALIDATION_FILES = (
    "bench_20mbit_b16_seeds3.json", "bench_100mbit_b16_3seeds.json", "bench_100mbit_b16_s0_local.json",
    "bench_100mbit_b64_3seeds.json", "bench_1gbit_b16_3seeds.json", "bench_1gbit_b16_loss_3seeds.json",
    "bench_hetero_b96_3seeds.json", "bench_hetero_b48_s0.json", "sweep_1gbit_b16.json", "sweep_1gbit_b64.json",
    "bench_b16_seed0.json", "smollm2_100mbit_2seeds.json", "smollm2_1gbit_2seeds.json",
)
# (bench_20mbit_b16_s0.json and bench_20mbit_b16_seeds.json are earlier merges of the seeds3 file)

# benchmark mode name -> planner mode (PowerSGD is torch's hook, not modelled)
BENCH_MODES = {
    "torch-ddp": (Mode("torch-ddp"), "speed"),
    "zero1": (Mode("zero1"), "speed"),
    "zero1+equal-shares": (Mode("zero1"), "equal"),
    "acco": (Mode("acco"), "speed"),
    "acco+loco4": (Mode("acco", "loco4", "int8"), "speed"),
    "acco+loco4+int4params": (Mode("acco", "loco4", "int4"), "speed"),
    "onebit-adam": (Mode("onebit_adam"), "speed"),
    "diloco-h15": (Mode("diloco", inner_steps=15), "speed"),
    "sparseloco-h15": (Mode("sparseloco", inner_steps=15), "speed"),
    "sparseloco-h50": (Mode("sparseloco", inner_steps=50), "speed"),
    "sparseloco-h15+overlap": (Mode("sparseloco", inner_steps=15, outer_overlap=True), "speed"),
}

# --hetero: 3 workers, two sharing core 0 and one alone on core 1 (recipes/benchmark.py)
HETERO_SPEEDS = (1.0, 1.0, 2.0)


# a file whose compute-only pace, measured before every seed and at the end, moved by more than
# this factor ran on a machine shared with other load: the pace measured beside its runs does not
# describe them (bench_1gbit_b16_loss_3seeds: 22.1-33.8 samples/s, load average 2.6-2.8 on 2 cores;
# bench_b16_seed0: 28.8 -> 21.6, "a busier machine" in docs/results.md; sweep_1gbit_b64: 24.1-37.3)
LOADED_SPREAD = 1.3


def pace_spread(doc: dict) -> float:
    by_mb: dict[int, list[float]] = {}
    for c in doc.get("compute_only", []):
        by_mb.setdefault(c["micro_batch"], []).append(c["samples_per_s"])
    return max(max(v) / min(v) for v in by_mb.values())


def parse_rate(text: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if text.endswith(u):
            return float(text[: -len(u)]) * f
    raise ValueError(f"unknown rate {text!r}")


# SmolLM2-135M (hidden 576, 30 blocks, 9 query and 3 key/value heads of 64, MLP 1536, vocabulary
# 49152, tied embeddings): 134,515,008 parameters; a block holds 2 x 576^2 (q, o) + 2 x 576 x 192
# (k, v) + 3 x 576 x 1536 (MLP) + 2 x 576 (norms) = 3,540,096, the final norm 576
SMOLLM2 = {"params": 134_515_008, "layers": 30, "hidden": 576, "vocab": 49152, "block": 3_540_096, "norm": 576}


def testbed_shape(cfg: dict) -> ModelShape:
    """The benchmark's model: the quick start's SmolLM2-135M with its top ``train_layers`` blocks
    and final norm trainable (``--model smollm2``), or the GPT-2 below."""
    if cfg.get("model") == "smollm2":
        trainable = cfg["train_layers"] * SMOLLM2["block"] + SMOLLM2["norm"]
        return ModelShape(SMOLLM2["params"], SMOLLM2["layers"], SMOLLM2["hidden"], SMOLLM2["vocab"],
                          cfg["seq_len"], trainable_fraction=trainable / SMOLLM2["params"])
    return gpt2_shape(cfg)


def gpt2_shape(cfg: dict) -> ModelShape:
    """The benchmark's GPT-2 (lm.models.tiny_gpt2: byte vocabulary 257, seq_len + 1 positions,
    tied embeddings), counted exactly: 12 L h^2 + 13 L h + 2 h + (257 + seq_len + 1) h."""
    L, h, t = cfg["n_layer"], cfg["n_embd"], cfg["seq_len"]
    params = 12 * L * h * h + 13 * L * h + 2 * h + (257 + t + 1) * h
    return ModelShape(params, L, h, 257, t)


@dataclass
class Row:
    file: str
    mode: str
    layout: str
    rate: str
    batch: str
    predicted_s: float
    measured_s: float
    predicted_bytes: float
    measured_bytes: float
    loaded: bool = False

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def rows(files=VALIDATION_FILES, constants: dict | None = None) -> list[Row]:
    out = []
    for name in files:
        doc = json.loads((RESULTS / name).read_text())
        cfg = doc["config"]
        shape = testbed_shape(cfg)
        loaded = pace_spread(doc) > LOADED_SPREAD
        for o in doc["modes"]:
            if o["mode"] not in BENCH_MODES:
                continue
            mode, balance = BENCH_MODES[o["mode"]]
            n = o["workers"]
            rate = parse_rate(o["rate"])
            hw = cpu_testbed(rate, o["compute_only_samples_per_s"] / n, constants)
            batch = Batch(int(o["samples_per_step"]), int(o["micro_batch"]))
            speeds = HETERO_SPEEDS if o.get("hetero") else None
            pred = step_time(mode, shape, Layout(n, 1), hw, batch, WireSettings(), speeds, balance)
            if mode.strategy == "onebit_adam":  # the median step is a compressed one
                measured_s, measured_b = o["step_time_median_s"], o["wire_bytes_per_step_after_freeze"]
            elif mode.local_steps:  # the outer round's cost is in the mean step, not the median
                measured_s, measured_b = o["step_time_mean_s"], o["wire_bytes_per_step_engine"]
            else:
                measured_s, measured_b = o["step_time_median_s"], o["wire_bytes_per_step_engine"]
            out.append(Row(name, o["mode"], f"{n}x1" + (" hetero" if o.get("hetero") else ""), o["rate"],
                           f"B={batch.global_samples}, mb={batch.micro_batch}", pred.step_s, measured_s,
                           pred.bytes.rank, measured_b, loaded))
    return out


# the testbed's node layouts (issue 22): each node a network namespace behind one shaped link
NODE_FILES = (
    "nodes_flat_2x2.json", "nodes_flat_2x4.json", "nodes_flat_2x8.json", "nodes_100mbit_b16_2x2_2seeds.json",
    "nodes_100mbit_b16_2x2_attribution.json", "nodes_two_level_2x4.json", "nodes_20mbit_sparseloco_2x2.json",
)


def node_link_rows(files=NODE_FILES) -> list[tuple[str, str, str, float, float]]:
    """(file, mode, layout, predicted, measured) bytes through node 0's link per (inner) step: the
    planner's payload against the node veth's tx counter (which adds TCP/IP framing)."""
    out = []
    for name in files:
        doc = json.loads((RESULTS / name).read_text())
        shape = testbed_shape(doc["config"])
        for o in doc["modes"]:
            base, _, topology = o["mode"].partition("@")
            if base not in BENCH_MODES or not o.get("node0_link_bytes_per_step"):
                continue
            mode = BENCH_MODES[base][0]
            if not mode.is_ddp:
                mode = replace(mode, exchange="two-level" if topology == "two_level" else "flat")
            m, g = o["nodes"], o["ranks_per_node"]
            pred = step_bytes(shape.params, Layout(m, g), mode, WireSettings()).node_link
            out.append((name, o["mode"], f"{m}x{g}", pred, o["node0_link_bytes_per_step"]))
    return out


def _per_step(o: dict, thread: tuple[str, ...]) -> float:
    """Median over the row's runs (its chosen lr) and ranks of the named threads' CPU per step."""
    runs = [r for r in o["runs"] if r["lr"] == o["lr"]]
    return statistics.median(statistics.median(sum(t.get(k, 0.0) for k in thread) for t in r["thread_cpu_s_per_rank"])
                             / r["steps"] for r in runs)


def measure_constants(files=VALIDATION_FILES) -> dict:
    """The testbed constants of hardware.TESTBED_CONSTANTS, recomputed from the JSONs: the comm
    thread's CPU per step over (rounds x parameters) for the sharded rounds, per parameter for
    1-bit Adam's step and for an outer round (x H); gloo's threads' CPU per byte sent (slow =
    <= 100 Mbit/s, fast = 1 Gbit/s; sparseloco's few bytes left out); the tx counters over Comm's
    bytes; gloo's achieved fraction of the line on torch DDP's rows."""
    acc: dict[str, list[float]] = {}
    for name in files:
        doc = json.loads((RESULTS / name).read_text())
        shape = testbed_shape(doc["config"])
        if pace_spread(doc) > LOADED_SPREAD:
            continue
        for o in doc["modes"]:
            if o["mode"] not in BENCH_MODES:
                continue
            mode, _ = BENCH_MODES[o["mode"]]
            rate = parse_rate(o["rate"])
            cls = "fast" if rate >= 5e8 else "slow"
            comm = _per_step(o, ("acco-loco-comm",))
            gloo = _per_step(o, ("gloo_tcp_loop", "pt_gloo_runloop"))
            if mode.is_ddp:
                pass
            elif mode.local_steps:
                acc.setdefault(mode.spec.outer_cost, []).append(comm * mode.inner_steps / shape.params)
            elif "round_s_per_param" in (work := mode.spec.work(1, 1, 1, mode)):  # the sharded rounds
                acc.setdefault("round_s_per_param", []).append(comm / (mode.rounds * shape.params))
            else:  # a full-size step of its own (1-bit Adam's)
                acc.setdefault(next(iter(work)), []).append(comm / shape.params)
            if mode.strategy != "sparseloco":
                acc.setdefault(f"transport_s_per_byte.{cls}", []).append(gloo / o["wire_bytes_per_step_engine"])
            if o.get("tx_over_engine"):
                acc.setdefault(f"framing.{cls}", []).append(o["tx_over_engine"])
            if mode.is_ddp and not o.get("hetero"):  # one value per run (seed): a 3-seed row weighs 3
                t_c = o["samples_per_step"] / o["compute_only_samples_per_s"]
                wire = o["wire_bytes_per_step_engine"] * o["tx_over_engine"] * 8 / rate
                for r in (r for r in o["runs"] if r["lr"] == o["lr"]):
                    busy = r["step_time_median_s"] - t_c - r["phase_median_s"].get("optimizer", 0.0)
                    acc.setdefault(f"link_efficiency.{o['rate']}", []).append(min(1.0, wire / busy))
    return {k: float(f"{statistics.median(v):.3g}") for k, v in sorted(acc.items())}


def summary(rs: list[Row]) -> dict:
    errs = [abs(r.error) for r in rs]
    clean = [abs(r.error) for r in rs if not r.loaded]
    eng = [abs(r.error) for r in rs if r.mode != "torch-ddp"]
    eng_clean = [abs(r.error) for r in rs if r.mode != "torch-ddp" and not r.loaded]
    return {"rows": len(rs), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
            "clean_rows": len(clean), "clean_median_abs_error": statistics.median(clean),
            "clean_max_abs_error": max(clean),
            # torch DDP's rows set the link efficiency (hardware.TESTBED_CONSTANTS): the engine rows
            # are the ones that check the model independently
            "engine_rows": len(eng), "engine_median_abs_error": statistics.median(eng),
            "engine_max_abs_error": max(eng), "engine_clean_max_abs_error": max(eng_clean),
            "bytes_exact": all(r.predicted_bytes == r.measured_bytes for r in rs)}


def table(rs: list[Row]) -> str:
    lines = ["| JSON | mode | layout | link | batch | predicted s/step | measured s/step | error "
             "| bytes/step predicted = measured |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        same = ("yes" if r.predicted_bytes == r.measured_bytes
                else f"no ({r.predicted_bytes:.0f} vs {r.measured_bytes:.0f})")
        lines.append(f"| {r.file}{' (loaded)' if r.loaded else ''} | {r.mode} | {r.layout} | {r.rate} | "
                     f"{r.batch} | {r.predicted_s:.3f} | "
                     f"{r.measured_s:.3f} | {100 * r.error:+.1f}% | {r.predicted_bytes:,.0f} {same} |")
    return "\n".join(lines)


def main() -> None:
    rs = rows()
    print(table(rs))
    s = summary(rs)
    print(f"\n{s['rows']} rows: median |error| {100 * s['median_abs_error']:.1f}%, largest "
          f"{100 * s['max_abs_error']:.1f}%; the {s['clean_rows']} rows of files not marked loaded: median "
          f"{100 * s['clean_median_abs_error']:.1f}%, largest {100 * s['clean_max_abs_error']:.1f}%; "
          f"engine rows only (DDP's rows set the link efficiency): {s['engine_rows']} rows, median "
          f"{100 * s['engine_median_abs_error']:.1f}%, largest {100 * s['engine_max_abs_error']:.1f}% "
          f"({100 * s['engine_clean_max_abs_error']:.1f}% outside the loaded file); bytes exact: {s['bytes_exact']}")
    print("\nnode 0's link per (inner) step, the testbed's node layouts: planner payload vs the veth's tx counter")
    print("| file | mode | nodes x ranks | predicted | measured | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for name, mode, lay, pred, meas in node_link_rows():
        print(f"| {name} | {mode} | {lay} | {pred:,.0f} | {meas:,.0f} | {meas / pred:.3f} |")
    print("\nconstants recomputed from the JSONs' thread CPU counters (stated in engine/planner/hardware.py):")
    for k, v in measure_constants().items():
        print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
