"""The memory of every strategy under each layout, from the planner (engine/planner/memory.py),
for the users' layouts: the table of docs/memory.md.

    python -m benchmarks.memory_table                      # markdown, both layouts
    python -m benchmarks.memory_table --step-copy whole    # with the whole spare a step is proposed into

Bytes per GPU after a step, by what holds them (the categories the runtime's own accounting
measures: engine/runtime/memory_accounting.py), for Llama-3.1-70B on 8 nodes x 8 GPUs of 80 GB
and Llama-3.1-8B on 2 nodes x 8, bf16, B = 1024 x 4096 tokens, micro-batch 1, and whether state +
activations fit 79.6 GiB (with activation checkpointing where the plan needs it) and its host bytes a
DGX H100 node's 2048 GiB over its 8 GPUs; ``host``: the host memory per GPU of a row whose optimizer
or outer state is on the CPU (optimizer_offload='cpu', outer_state_device='cpu'). Formulas, not
measurements: where they are held against runs is docs/planning.md's. ``--step-copy``: the
engine's step_copy (default auto: on a GPU, piece-sized scratch instead of the spare)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from engine.parallel.topology import Layout
from engine.planner.hardware import NODE_HOST_GIB, gpu
from engine.planner.recommend import make_plan
from engine.planner.shape import PRESETS
from engine.planner.timeline import Batch
from engine.planner.wire import WireSettings
from engine.strategies.spec import STEP_COPIES

GIB = 2**30
CASES = (("70b", Layout(8, 8)), ("8b", Layout(2, 8)))
COLUMNS = ("parameters", "gradients", "optimizer", "codec state", "comm buffers", "state", "activations", "fits",
           "host")


def table(name: str, layout: Layout, step_copy: str = "auto") -> str:
    hw = replace(gpu(10, mfu=0.4), host_memory_bytes=NODE_HOST_GIB * GIB / layout.ranks_per_node)
    plan = make_plan(PRESETS[name], layout, hw, Batch(1024, 1),
                     WireSettings(compute_bytes=2, step_copy=step_copy))
    lines = [f"**{name.upper()} on {layout.nodes} nodes x {layout.ranks_per_node} GPUs** (GiB per GPU)", "",
             "| mode | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for r in sorted(plan.rows, key=lambda r: r.memory.total):
        m = r.memory
        cells = [m.params, m.grads, m.optimizer, m.codec_state, m.buffers, m.total, r.activations]
        fits = ("yes, checkpointed" if r.checkpointing else "yes") if r.fits else (
            "no: host" if m.host > hw.host_memory_bytes else "no")
        host = f"{m.host / GIB:.3g}" if m.host else "-"  # an offloaded optimizer's host memory (optimizer on CPU)
        lines.append(f"| {r.mode.name} | " + " | ".join(f"{v / GIB:.3g}" for v in cells) + f" | {fits} | {host} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step-copy", default="auto", choices=STEP_COPIES,
                    help="EngineConfig step_copy: where a step is proposed (auto: piece-sized scratch on a GPU)")
    a = ap.parse_args(argv)
    print("\n\n".join(table(name, layout, a.step_copy) for name, layout in CASES))


if __name__ == "__main__":
    main()
