"""``strategy="auto"`` (opt-in): the engine chooses its strategy and codecs at start, by the
planner's one decision rule (engine/planner/decide.py) on a probe of the cluster it runs on, for
the goal the config names (``auto_goal``, ``auto_loss_bound_pct``: engine/planner/goal.py;
docs/planning.md, "The decision rule").

Its candidates: the strategies the rule may choose (AdamW's update, or AdamW's one step late with
its correction: never a local-step method, 1-bit Adam or dpu), with no codec, LoCo-4 gradients, and
LoCo-4 with int8 or int4 parameter deltas (a codec or parameter codec the caller set is kept), on
the exchange the config's topology resolves to, with its model sharding and optimizer placement
(``optimizer_offload``). Each is priced by the
planner's time model from the measured link rate and the measured compute of a synthetic
micro-batch, and its loss per sample (or samples to AdamW's loss) comes from the measured
evidence of the results folder (``auto_results``, default ./docs/results where it exists), at the
run's batch and length; a mode without rows of its own is never chosen. Every rank probes with
the slowest rank's figures, so all ranks choose the same. The choice and its reasons are logged
(logger ``acco_loco``) and returned as an ``AutoChoice`` (the Engine keeps it as
``engine.auto_choice``).

The engine counts micro-batches, not samples: the loss figures are looked up at B = the
micro-batches per step (one sample each, a lower bound: the measured cost of ACCO falls with B,
so this errs towards the synchronous round) and a length of ``max_steps`` steps. The compute
probe times one synthetic sample per micro-batch: with larger micro-batches a run is more
compute-bound than assumed; ``python -m engine.plan --measure`` with the run's real micro-batch
is the precise tool.

The probe runs on the engine's own groups of the compute thread (engine/parallel/dims.py), never
on the default group, which stays the user's."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

log = logging.getLogger("acco_loco")

DEFAULT_RESULTS = Path("docs") / "results"  # relative to the current directory, as the planner's



@dataclass(frozen=True)
class AutoChoice:
    strategy: str
    codec: str
    param_codec: str
    why: str
    predicted_step_s: float = 0.0
    predicted_s_per_micro_batch: float = 0.0
    inter_Bps: float = 0.0
    samples_per_s: float = 0.0
    goal: str = ""


def auto_modes(cfg, layout) -> list:
    """The modes strategy="auto" may run under ``cfg`` on ``layout``: the decision's strategies
    with the codec variants the config leaves open (a codec the planner's table does not list:
    as given), on the exchange its topology resolves to, with its model sharding and optimizer
    placement."""
    from .planner.decide import candidate_strategies, runnable
    from .planner.modes import CODEC_VARIANTS, candidates

    codecs = [(c, p) for c, p in CODEC_VARIANTS
              if (cfg.codec == "none" or c == cfg.codec) and (cfg.param_codec == "auto" or p == cfg.param_codec)]
    codecs = codecs or [(cfg.codec, cfg.param_codec)]
    strategies = candidate_strategies()
    bases = [m for m in candidates(two_level=layout.ranks_per_node > 1)
             if not m.is_ddp and m.strategy in strategies and (m.codec, m.param_codec) == ("none", "auto")
             and runnable(m, layout, cfg.topology, cfg.model_sharding, cfg.optimizer_offload)]
    return [replace(m, codec=c, param_codec=p) for m in bases for c, p in codecs]


def decide_auto(cfg, shape, layout, hw, ws, results: Path | None, steps: int | None, batch=None,
                label: str = "this run"):
    """The decision strategy="auto" takes once the probe has measured ``hw``: the planner's rows
    of ``auto_modes`` and ``decide`` with the config's goal. ``batch``: the global batch (default:
    from the config, in micro-batches of one sample: ``global_micro_batches``, or ``micro_batches``
    x world x the mode's rounds). Returns (the chosen PlanRow or None, the Decision, the rows)."""
    from .planner.decide import decide
    from .planner.goal import Goal
    from .planner.recommend import plan_rows
    from .planner.timeline import Batch

    goal = Goal(cfg.auto_goal, cfg.auto_loss_bound_pct, cfg.optimizer)
    modes = auto_modes(cfg, layout)
    groups: dict[int, list] = {}
    for m in modes:
        if batch is not None:
            per_step = batch.global_samples
        elif cfg.global_micro_batches is not None:
            per_step = cfg.global_micro_batches
            if per_step < m.rounds * layout.world:
                continue  # each round needs a micro-batch per worker (docs/design/rounds.md)
        else:
            per_step = cfg.micro_batches * layout.world * m.rounds
        groups.setdefault(per_step, []).append(m)
    rows = []
    for per_step, ms in groups.items():
        b = batch if batch is not None else Batch(per_step, 1)
        got, _ = plan_rows(shape, layout, hw, b, ws, ms, hw.memory_bytes, steps, results, "auto", label,
                           with_reference=False, optimizer=cfg.optimizer)
        rows += got
    decision = decide(rows, goal)
    return decision.choice, decision, rows


def _results_folder(cfg) -> Path | None:
    folder = Path(cfg.auto_results) if cfg.auto_results else DEFAULT_RESULTS
    return folder if folder.is_dir() else None


def choose_strategy(cfg, model: torch.nn.Module, dims):
    """(cfg, None) unless ``cfg.strategy == "auto"``; then (a copy with the chosen strategy, codec
    and param_codec, the AutoChoice that says why)."""
    if cfg.strategy != "auto":
        return cfg, None
    from .core.dtypes import resolve_compute_dtype
    from .parallel.topology import Layout
    from .planner.decide import candidate_strategies
    from .planner.hardware import H100_MEM_GIB, cpu_testbed, gpu
    from .planner.modes import Mode
    from .planner.probe import model_step, probe_cluster, time_compute
    from .planner.shape import ModelShape
    from .planner.wire import WireSettings

    params = [p for p in model.parameters() if p.requires_grad]
    device, rank, world = dims.device, dims.rank, dims.world
    out = copy.deepcopy(cfg)
    if world == 1:  # nothing to exchange: the synchronous one (one round, no overlap)
        out.strategy = min(candidate_strategies(), key=lambda s: (Mode(s).rounds, Mode(s).overlap))
        out.validate()
        why = f"strategy=auto -> {out.strategy} (world size 1: nothing to exchange)"
        log.info(why)
        return out, AutoChoice(out.strategy, out.codec, out.param_codec, why, goal=cfg.auto_goal)
    numel = sum(p.numel() for p in params)
    try:
        step = model_step(model, 1)
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"strategy='auto' cannot time this model's forward on a synthetic batch ({exc}): "
                         "set the strategy yourself (python -m engine.plan says which)") from exc
    measured = probe_cluster(None, 1, None, payload=min(8 * 2**20, max(2**20, numel * 4)), repeats=2, dims=dims)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}  # e.g. BatchNorm's running stats
    samples_per_s = time_compute(step, 1, device, dims.comm("control").group, repeats=2)
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(buffers[k])
    dtype = resolve_compute_dtype(cfg.compute_dtype, params[0].dtype)
    ws = WireSettings(compute_bytes=torch.empty((), dtype=dtype).element_size(), group_size=cfg.group_size,
                      scale_dtype=cfg.scale_dtype, grad_dtype=cfg.grad_dtype, step_copy=cfg.step_copy)
    if device.type == "cuda":
        mem_gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if torch.cuda.is_available() \
            else H100_MEM_GIB
        hw = gpu(measured.inter_Bps * 8 / 1e9, measured.intra_Bps / 1e9 or 450.0, samples_per_s=samples_per_s,
                 mem_gib=mem_gib)
    else:
        hw = cpu_testbed(measured.inter_Bps * 8, samples_per_s)
    shape = ModelShape(numel, 1, 1, 1, 1)
    layout = Layout(measured.nodes, measured.per_node)
    results = _results_folder(cfg)
    choice, decision, rows = decide_auto(cfg, shape, layout, hw, ws, results, cfg.max_steps)
    if choice is None:  # nothing measured meets the goal here: AdamW's own update, the synchronous round
        out.strategy = min(candidate_strategies(), key=lambda s: (Mode(s).rounds, Mode(s).overlap))
        out.validate()
        why = (f"strategy=auto -> {out.strategy} (the synchronous round: AdamW's own update"
               + (", with the codecs you set" if (cfg.codec, cfg.param_codec) != ("none", "auto") else "")
               + f"): the rule took nothing: {decision.why}"
               + ("" if results is not None else f" No results folder at {DEFAULT_RESULTS.resolve()}: set "
                  "auto_results to the repository's docs/results for measured loss figures."))
        if rank == 0:
            log.info(why)
        return out, AutoChoice(out.strategy, out.codec, out.param_codec, why, goal=cfg.auto_goal)
    mode, t = choice.mode, choice.time
    out.strategy, out.codec, out.param_codec = mode.strategy, mode.codec, mode.param_codec
    out.validate()
    per_micro = t.step_s / choice.samples_per_step
    others = sorted((r for r in rows if r is not choice), key=lambda r: r.time.step_s / r.samples_per_step)[:5]
    why = (f"strategy=auto -> {mode.name}: {decision.why} The probe measured: {measured.describe()}, compute "
           f"{samples_per_s:.3g} synthetic samples/s; B = {choice.samples_per_step} micro-batches per step (one "
           f"sample each, the engine does not know more), {cfg.max_steps} steps; predicted {per_micro * 1e3:.3g} ms "
           "per micro-batch; others: "
           + ", ".join(f"{r.mode.name} {r.time.step_s / r.samples_per_step * 1e3:.3g} ms" for r in others))
    if rank == 0:
        log.info(why)
    return out, AutoChoice(mode.strategy, mode.codec, mode.param_codec, why, t.step_s, per_micro,
                           measured.inter_Bps, samples_per_s, cfg.auto_goal)
