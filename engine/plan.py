"""Plan a run before renting the cluster: ``python -m engine.plan``.

Predicts, for every strategy and codec the engine has (and torch DDP), the step time, the bytes
through each node's link, the training state and activations per GPU, whether they fit its
memory, and the measured loss per sample against AdamW at the run's batch and length, then recommends
one by the decision rule strategy="auto" uses (--goal), with the evidence behind it, and says
why, or, when none fits, what would (docs/planning.md). The
measured losses come from the benchmark JSONs of --results (default ./docs/results: run it from
the repository's root, or name the folder).

    python -m engine.plan --model 8b --nodes 8 --gpus-per-node 8 --inter-gbit 10 \\
        --global-batch 1024 --micro-batch 4
    python -m engine.plan --model path/to/hf_folder --trainable-fraction 0.1 --nodes 2 ...
    python -m engine.plan --params 4837888 --layers 6 --hidden 256 --vocab 257 --seq-len 128 \\
        --cpu-testbed --nodes 2 --inter-gbit 0.1 --samples-per-s 17 --global-batch 16 --micro-batch 4
    torchrun --nnodes 2 --nproc-per-node 8 -m engine.plan --measure --model 1b ...   # probe this cluster
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from .parallel.topology import Layout
from .planner.fit import CHECKPOINTING
from .planner.goal import DEFAULT_GOAL, DEFAULT_LOSS_BOUND_PCT, GOALS, OPTIMIZER_NAMES, Goal
from .planner.hardware import H100_BF16_FLOPS, H100_MEM_GIB, NODE_HOST_GIB, cpu_testbed, gpu
from .planner.modes import candidates
from .planner.recommend import format_plan, make_plan
from .planner.shape import PRESETS, from_shape, from_transformers
from .planner.timeline import Batch
from .planner.wire import WireSettings

DEFAULT_RESULTS = Path("docs") / "results"  # relative to the current directory


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model")
    m.add_argument("--model", help="a transformers config folder / hub id, or a preset: " + ", ".join(PRESETS))
    m.add_argument("--params", type=int, help="parameter count (with --layers, --hidden, --vocab) instead of --model")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--vocab", type=int, default=32000)
    m.add_argument("--seq-len", type=int, help="tokens per sample (default: the preset's or the config's, max 4096)")
    m.add_argument("--trainable-fraction", type=float, default=1.0, help="fraction of the parameters trained")
    c = ap.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=2, help="M nodes")
    c.add_argument("--gpus-per-node", type=int, default=1, help="G ranks per node")
    c.add_argument("--inter-gbit", type=float, default=10.0, help="one node's network link, Gbit/s")
    c.add_argument("--intra-gbyte", type=float, default=450.0, help="per-GPU bandwidth inside a node, GB/s (NVLink 4: 450)")
    c.add_argument("--tflops", type=float, default=H100_BF16_FLOPS / 1e12, help="peak TFLOP/s per GPU (H100 bf16: 989)")
    c.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the compute")
    c.add_argument("--gpu-mem-gib", type=float, default=None,
                   help=f"one GPU's memory, GiB (default: the H100 80GB's {H100_MEM_GIB}; with --cpu-testbed: not checked)")
    c.add_argument("--host-mem-gib", type=float, default=None,
                   help=f"one node's host memory, GiB, shared by its GPUs' offloaded state (default: a DGX H100's "
                        f"{NODE_HOST_GIB}; with --cpu-testbed: not checked; 0: not checked)")
    c.add_argument("--samples-per-s", type=float, default=0.0, help="measured samples/s per worker (overrides FLOPs x MFU)")
    c.add_argument("--cpu-testbed", action="store_true",
                   help="price the comm side as the CPU testbed does (one core per worker, gloo; docs/planning.md)")
    c.add_argument("--measure", action="store_true",
                   help="probe the cluster this runs on (under torchrun): link rates and compute instead of the flags")
    b = ap.add_argument_group("batch")
    b.add_argument("--global-batch", type=int, default=1024, help="samples per optimizer step, all workers")
    b.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch per worker")
    b.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    b.add_argument("--grad-dtype", choices=("auto", "compute"), default="auto",
                   help="EngineConfig grad_dtype, the gradient buffers' and an uncompressed gradient's dtype: "
                        "auto = float32 under a gradient codec and for local-step modes, the compute dtype where the "
                        "gradient travels uncompressed and for model-sharded modes; compute = the compute dtype")
    b.add_argument("--activation-checkpointing", choices=CHECKPOINTING, default="auto",
                   help="per block: auto = only for the modes that do not fit without it (its recompute is "
                   "in their step time)")
    b.add_argument("--steps", type=int, help="optimizer steps of the planned run: the samples each mode needs to "
                   "reach AdamW's loss come from the benchmark runs nearest that length (default: all runs)")
    d = ap.add_argument_group("decision (the rule strategy='auto' uses too: engine/planner/decide.py)")
    d.add_argument("--goal", choices=GOALS, default=DEFAULT_GOAL,
                   help="loss_per_sample = the fastest mode whose measured loss per sample is within --loss-bound of "
                        "AdamW's; time_to_loss = the least predicted time to AdamW's loss (EngineConfig auto_goal)")
    d.add_argument("--optimizer", choices=tuple(OPTIMIZER_NAMES), default="adamw",
                   help="the optimizer the run steps with (EngineConfig optimizer): every loss figure is measured "
                        "against torch DDP with the same one, and a mode without such rows is not measured")
    d.add_argument("--loss-bound", type=float, default=DEFAULT_LOSS_BOUND_PCT, metavar="PCT",
                   help="with --goal loss_per_sample: the most held-out loss above AdamW's at equal samples, percent "
                        "(EngineConfig auto_loss_bound_pct)")
    d.add_argument("--topology", choices=("auto", "flat", "two_level"), default="auto",
                   help="the run's exchange as EngineConfig's topology: the recommendation runs it (auto = two-level "
                        "at >= 2 nodes of >= 2 ranks)")
    d.add_argument("--model-sharding", choices=("any", "none", "node"), default="any",
                   help="the run's model_sharding: any = the recommendation may take either")
    d.add_argument("--optimizer-offload", choices=("any", "none", "cpu"), default="any",
                   help="the run's optimizer_offload: any = the recommendation may take either")
    ap.add_argument("--flat-only", action="store_true", help="leave the two-level exchange (and node sharding) out")
    ap.add_argument("--results", type=Path, default=None,
                    help=f"the benchmark JSONs the measured losses come from (default: ./{DEFAULT_RESULTS})")
    ap.add_argument("--json", help="write the plan here as JSON")
    return ap


def shape_from(a):
    if a.model and a.model.lower() in PRESETS:
        base = PRESETS[a.model.lower()]
        return from_shape(base.layers, base.hidden, base.vocab, base.params, a.seq_len or base.seq_len,
                          a.trainable_fraction)
    if a.model:
        try:
            return from_transformers(a.model, a.seq_len, a.trainable_fraction)
        except OSError as exc:
            raise SystemExit(f"--model {a.model!r}: no transformers config there ({exc.__class__.__name__}); give a "
                             f"folder with config.json, a hub id with a network, or a preset: {', '.join(PRESETS)}")
    if not (a.params or (a.layers and a.hidden)):
        raise SystemExit("give --model (a transformers config folder or a preset), or --layers and --hidden "
                         "(with --params for an exact count)")
    if not (a.layers and a.hidden):
        raise SystemExit("--params needs the shape too: --layers and --hidden (and --vocab)")
    return from_shape(a.layers, a.hidden, a.vocab, a.params, a.seq_len or 2048, a.trainable_fraction)


def probe_model(a, shape):
    """The model whose micro-batches --measure times: built from its transformers config with
    random weights on this rank's device (bf16 on GPU), when it fits; else None (FLOPs x MFU)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 * 2**30
    if shape.params * 18 > free:  # weights, gradients, activations: leave it to the stated FLOP rate
        print(f"--measure: {shape.params / 1e9:.3g}B parameters do not fit here for a compute probe; "
              "compute from --tflops x --mfu")
        return None
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if a.model and a.model.lower() not in PRESETS:
        cfg = AutoConfig.from_pretrained(a.model)
    else:  # a preset or a stated shape: a Llama-style decoder of that shape
        cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                          num_attention_heads=max(1, shape.hidden // 128), intermediate_size=4 * shape.hidden,
                          max_position_embeddings=shape.seq_len)
    dtype = torch.bfloat16 if (device.type == "cuda" and a.compute_dtype == "bfloat16") else torch.float32
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype)
    if shape.trainable_fraction < 1:  # train the top fraction of the parameters, as a fine-tune would
        params = list(model.parameters())
        budget = shape.trainable
        for p in reversed(params):
            p.requires_grad_(budget > 0)
            budget -= p.numel()
    return model


def results_folder(given: Path | None) -> Path:
    """--results, or ./docs/results where it exists; a clear exit otherwise."""
    folder = given if given is not None else DEFAULT_RESULTS
    if not folder.is_dir():
        raise SystemExit(f"no results folder at {folder.resolve()}: the planner's measured loss per sample comes "
                         "from the benchmark JSONs of the repository's docs/results; run it from the repository's "
                         "root or pass --results path/to/docs/results")
    return folder


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    results = results_folder(a.results)
    shape = shape_from(a)
    layout = Layout(a.nodes, a.gpus_per_node)
    ws = WireSettings(compute_bytes=2 if a.compute_dtype == "bfloat16" else 4, grad_dtype=a.grad_dtype)
    batch = Batch(a.global_batch, a.micro_batch)
    measured = None
    if a.measure:
        from .planner.probe import probe_cluster

        model = None if a.samples_per_s else probe_model(a, shape)
        measured = probe_cluster(shape, a.micro_batch, model)
        layout = Layout(measured.nodes, measured.per_node)
        a.inter_gbit = measured.inter_Bps * 8 / 1e9 if measured.nodes > 1 else a.inter_gbit
        a.intra_gbyte = measured.intra_Bps / 1e9 if measured.per_node > 1 else a.intra_gbyte
        a.samples_per_s = a.samples_per_s or measured.samples_per_s
    if a.cpu_testbed:
        if a.samples_per_s <= 0:
            raise SystemExit("--cpu-testbed needs --samples-per-s (the compute-only pace per worker) or --measure")
        hw = cpu_testbed(a.inter_gbit * 1e9, a.samples_per_s)
        if a.gpu_mem_gib:
            hw = replace(hw, memory_bytes=a.gpu_mem_gib * 2**30)
    else:
        hw = gpu(a.inter_gbit, a.intra_gbyte, a.tflops * 1e12, a.mfu, a.samples_per_s,
                 mem_gib=a.gpu_mem_gib or H100_MEM_GIB)
    host_gib = a.host_mem_gib if a.host_mem_gib is not None else (0.0 if a.cpu_testbed else NODE_HOST_GIB)
    if host_gib < 0:
        raise SystemExit(f"--host-mem-gib {a.host_mem_gib}: give one node's host memory in GiB (0: not checked)")
    hw = replace(hw, host_memory_bytes=host_gib * 2**30 / layout.ranks_per_node)
    if a.global_batch < layout.world:
        raise SystemExit(f"--global-batch {a.global_batch} gives some of the {layout.world} ranks no sample: "
                         "raise it to at least one sample per rank")
    if a.steps is not None and a.steps < 1:
        raise SystemExit(f"--steps {a.steps}: give the planned run's optimizer steps, at least 1")
    try:
        goal = Goal(a.goal, a.loss_bound, a.optimizer)
    except ValueError as exc:
        raise SystemExit(f"--loss-bound: {exc}")
    if a.flat_only and a.topology == "two_level":
        raise SystemExit("--flat-only leaves out the two-level exchange that --topology two_level asks for")
    plan = make_plan(shape, layout, hw, batch, ws, modes=candidates(two_level=False) if a.flat_only else None,
                     steps=a.steps, results=results, checkpointing=a.activation_checkpointing, goal=goal,
                     topology="flat" if a.flat_only else a.topology,
                     model_sharding=None if a.model_sharding == "any" else a.model_sharding,
                     optimizer_offload=None if a.optimizer_offload == "any" else a.optimizer_offload)
    if measured is not None and measured.rank != 0:
        return 0
    print(f"model: {shape.params / 1e9:.3g}B parameters ({shape.trainable / 1e9:.3g}B trained), {shape.layers} "
          f"layers x {shape.hidden}, {shape.seq_len} tokens/sample; {layout.nodes} nodes x {layout.ranks_per_node} "
          f"ranks; node link {a.inter_gbit:g} Gbit/s, inside the node {a.intra_gbyte:g} GB/s; "
          + (f"compute {a.samples_per_s:.3g} samples/s per worker (measured)" if a.samples_per_s else
             f"compute {a.tflops:g} TFLOP/s x MFU {a.mfu:g}")
          + f"; batch {a.global_batch} samples/step, micro-batch {a.micro_batch}, {a.compute_dtype}"
          + (f"; {hw.memory_bytes / 2**30:.3g} GiB per GPU" if hw.memory_bytes else "")
          + (f", {host_gib:g} GiB of host memory per node" if host_gib else ""))
    if measured is not None:
        print("measured: " + measured.describe())
    print(format_plan(plan))
    if a.json:
        out = {"args": vars(a), "rows": [{"mode": r.mode.name, "settings": asdict(r.mode),
                                          "step_s": r.time.step_s, "speedup_vs_ddp": r.speedup_vs_ddp,
                                          "compute_s": r.time.compute_s, "inter_s": r.time.inter_s,
                                          "intra_s": r.time.intra_s, "node_link_bytes": r.time.bytes.node_link,
                                          "rank_bytes": r.time.bytes.rank, "intra_rank_bytes": r.time.bytes.intra_rank,
                                          "memory_bytes": r.memory.total, "memory": asdict(r.memory),
                                          "activation_bytes": r.activations, "checkpointing": r.checkpointing,
                                          "fits": r.fits,
                                          "loss_vs_adamw_pct": r.loss.value,
                                          "loss_evidence": r.loss.evidence(),
                                          "loss_beyond": r.loss.beyond,
                                          "loss_sources": [p.describe() for p in r.loss.basis],
                                          "loss_not_measured": r.loss.not_measured(),
                                          "samples_to_adamw_loss": r.factor.value,
                                          "samples_sources": [p.describe() for p in r.factor.basis],
                                          "to_loss_vs_ddp": r.to_loss_vs_ddp} for r in plan.rows],
               "goal": {"kind": goal.kind, "loss_bound_pct": goal.loss_bound_pct, "optimizer": goal.optimizer},
               "recommended": plan.choice.mode.name if plan.choice else None, "why": plan.why,
               "soonest": plan.soonest.mode.name if plan.soonest else None, "why_soonest": plan.why_soonest,
               "measured": asdict(measured) if measured is not None else None}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0 if plan.choice is not None else 1


if __name__ == "__main__":
    sys.exit(main())
