"""``strategy="auto"`` (opt-in): the engine chooses its strategy and codecs at start from the
planner and a probe of the cluster it runs on (docs/planning.md, "strategy=auto").

Among the strategies whose spec says their update is AdamW's (never a local-step method, never
1-bit Adam, never dpu's uncorrected stale update: STALE_UPDATES), with no codec, LoCo-4 gradients, and LoCo-4 with int8 or int4 parameter deltas (a
codec or parameter codec the caller set is kept), it predicts the time per sample of each from
the measured link rate and the measured compute of a synthetic micro-batch, and takes the
fastest; modes within 3% of it count as equally fast and the one with the fewest lossy codecs
and rounds is taken. Every rank probes with the slowest rank's figures, so all ranks choose the
same. The choice and its predicted figures are logged (logger ``acco_loco``) and returned as an
``AutoChoice`` (the Engine keeps it as ``engine.auto_choice``).

The probe runs on the engine's own groups of the compute thread (engine/parallel/dims.py), never
on the default group, which stays the user's.

The compute probe times one synthetic sample per micro-batch (a sequence of up to 512 tokens for
a transformers model, one row for a model that starts with a Linear layer): a run whose
micro-batches hold more samples is more compute-bound than the probe assumes, so the choice
leans towards the codecs; ``python -m engine.plan --measure`` with the run's real micro-batch
is the precise tool (it also prints the measured loss per sample, which the engine has no
results folder for)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("acco_loco")

# Left out although their spec is AdamW's class: dpu's update is AdamW's one step late with no
# correction, +16.9% held-out loss against DDP at 3072 samples (docs/results.md, issue 35) and a
# diverged seed at 1 Gbit/s; a default must keep AdamW's loss per sample (acco corrects the delay).
STALE_UPDATES = ("dpu",)


def candidate_strategies() -> tuple[str, ...]:
    from .planner.modes import auto_strategies  # the planner loads when auto is used

    return tuple(s for s in auto_strategies() if s not in STALE_UPDATES)


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


def choose_strategy(cfg, model: torch.nn.Module, dims):
    """(cfg, None) unless ``cfg.strategy == "auto"``; then (a copy with the chosen strategy, codec
    and param_codec, the AutoChoice that says why)."""
    if cfg.strategy != "auto":
        return cfg, None
    from .core.dtypes import resolve_compute_dtype
    from .parallel.topology import Layout
    from .planner.hardware import cpu_testbed, gpu
    from .planner.modes import CODEC_VARIANTS, Mode
    from .planner.probe import model_step, probe_cluster, time_compute
    from .planner.recommend import TIE, simplicity
    from .planner.shape import ModelShape
    from .planner.timeline import Batch, step_time
    from .planner.wire import WireSettings

    params = [p for p in model.parameters() if p.requires_grad]
    device, rank, world = dims.device, dims.rank, dims.world
    out = copy.deepcopy(cfg)
    if world == 1:  # nothing to exchange: the synchronous one (one round, no overlap)
        out.strategy = min(candidate_strategies(), key=lambda s: (Mode(s).rounds, Mode(s).overlap))
        out.validate()
        why = f"strategy=auto -> {out.strategy} (world size 1: nothing to exchange)"
        log.info(why)
        return out, AutoChoice(out.strategy, out.codec, out.param_codec, why)
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
    hw = (gpu(measured.inter_Bps * 8 / 1e9, measured.intra_Bps / 1e9 or 450.0, samples_per_s=samples_per_s)
          if device.type == "cuda" else cpu_testbed(measured.inter_Bps * 8, samples_per_s))
    shape = ModelShape(numel, 1, 1, 1, 1)
    layout = Layout(measured.nodes, measured.per_node)
    codecs = [(c, p) for c, p in CODEC_VARIANTS
              if (cfg.codec == "none" or c == cfg.codec) and (cfg.param_codec == "auto" or p == cfg.param_codec)]
    if not codecs:  # a codec the table does not list: keep it as given
        codecs = [(cfg.codec, cfg.param_codec)]
    scored = []
    for strategy in candidate_strategies():
        for codec, param_codec in codecs:
            mode = Mode(strategy, codec, param_codec)
            per_step = cfg.global_micro_batches or cfg.micro_batches * world * mode.rounds
            if cfg.global_micro_batches is not None and per_step < mode.rounds * world:
                continue  # each round needs a micro-batch per worker (docs/design/rounds.md)
            t = step_time(mode, shape, layout, hw, Batch(per_step, 1), ws)
            scored.append((t.step_s / per_step, mode, t))
    best = min(s for s, _, _ in scored)
    per_sample, mode, t = min((x for x in scored if x[0] <= best * (1 + TIE)),
                              key=lambda x: (simplicity(x[1]), x[0]))
    out.strategy, out.codec, out.param_codec = mode.strategy, mode.codec, mode.param_codec
    out.validate()
    why = (f"strategy=auto -> {mode.name}: predicted {per_sample * 1e3:.3g} ms per micro-batch "
           f"({t.step_s:.3g} s/step: compute {t.compute_s:.3g} s, node link {t.inter_s:.3g} s, comm-side work "
           f"{t.comm_work_s:.3g} s), {t.bytes.rank / 1e6:.4g} MB per rank per step; measured: {measured.describe()}, "
           f"compute {samples_per_s:.3g} synthetic samples/s; others: "
           + ", ".join(f"{m.name} {s * 1e3:.3g} ms" for s, m, _ in sorted(scored, key=lambda x: x[0])[:5]))
    if rank == 0:
        log.info(why)
    return out, AutoChoice(mode.strategy, mode.codec, mode.param_codec, why, t.step_s, per_sample,
                           measured.inter_Bps, samples_per_s)
