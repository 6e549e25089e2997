"""Resume at another world size: re-cut the state of N workers' checkpoint files for N' workers.

Every rank of the new run reads all N rank files (verified as usual) and builds the state dict its
``Engine.load_state_dict`` takes, by one rule per tensor (docs/elastic.md, "Checkpoints"):

  shard    the ZeRO-1 master and moments, 1-bit Adam's server error: concatenated in rank order,
           cut to the model's values, padded to the new buffer and sliced to the new shards
           (bit-exact: the full vectors are unchanged)
  shared   what every replica holds alike (DiLoCo's theta_sync and outer momentum, 1-bit Adam's
           momentum, frozen variance and mask): rank 0's, re-padded
  sum      error feedback (LoCo/EF error, 1-bit Adam's worker error, SparseLoCo's outer error):
           the sum over the old workers is kept and spread evenly, sum / N' on every new worker.
           What the workers owe the model is that sum (the next reduce adds every worker's
           error once); no worker's error belongs to a coordinate range, so an even spread is the
           one split that neither drops a departed worker's debt nor favours a survivor
  local    a local-step worker's own parameters and inner moments: new rank r keeps old rank
           r's when it existed; a new rank starts from theta_sync with old rank r mod N's inner
           moments; a departed worker's local progress since the last outer round is dropped
  dropped  the accumulated gradient not yet sent (its micro-batches are dealt again at the new
           shares, so the data position is kept: ``consumed`` steps back by them), measured
           speeds (measured again)

A checkpoint between the two rounds of an ACCO step (its kept half and the error-feedback mark
belong to that step's workers) or with an outer round in flight cannot be re-cut: resume it at its
own world size, or from a checkpoint at a step boundary (periodic checkpoints are).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from acco_loco.acco import RoundPlan
from acco_loco.registry import make_codec

from .rounds import RoundContext

log = logging.getLogger("acco_loco")

SHARED = ("outer.theta_sync", "outer.momentum", "onebit.momentum", "onebit.variance", "onebit.mask",
          "onebit.master")
SUMMED = ("onebit.worker_error", "outer.error")
LOCAL = ("local_params", "outer.submitted")
MID_STEP = ("kept_grad_sum",)


class ReshardError(ValueError):
    pass


def _repad(t: torch.Tensor, numel: int, padded: int, fill=0) -> torch.Tensor:
    out = torch.full((padded,), fill, dtype=t.dtype)
    out[:numel] = t[:numel]
    return out


def _recut(pieces: list[torch.Tensor], numel: int, padded: int, rank: int, world: int) -> torch.Tensor:
    full = _repad(torch.cat(pieces), numel, padded)
    shard = padded // world
    return full[rank * shard:(rank + 1) * shard].clone()


def _feedback_error(fb: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """One old worker's error-feedback error as fp32 (decoded from int8 storage)."""
    if "e" in fb:
        return fb["e"].to(torch.float32)
    codec = make_codec("int8", group_size=group_size, scale_dtype=torch.float32)
    return codec.decode(fb["e_codes"], fb["e_scales"])


def recut(ctx: RoundContext, plan: RoundPlan, topology: str, old: list[tuple[dict[str, torch.Tensor], dict]],
          where: str) -> tuple[dict, dict, dict]:
    """(tensors, meta) for this rank (``ctx``: its comm, flat buffer and gradient reducer; ``plan``
    and ``topology``: the new run's) from the N old ranks' (tensors, meta), and a report
    {carried, dropped} for the log."""
    if ctx.cfg.model_sharding != "none" or old[0][1].get("model_sharding", "none") != "none":
        return recut_rails(ctx, plan, old, where)  # each rail's chunks re-cut as a flat run's shards
    n, rank, world = len(old), ctx.comm.rank, ctx.comm.world_size
    flat = ctx.flat
    numel, padded = flat.numel, flat.padded
    meta0 = old[0][1]
    if meta0["numel"] != numel:
        raise ReshardError(f"{where} holds a model of {meta0['numel']} trainable values and this engine has "
                           f"{numel}: load it into the model it was saved from")
    if meta0["round_index"] % plan.rounds_per_step or meta0.get("kept") is not None:
        raise ReshardError(f"{where} was taken between the rounds of a step (round {meta0['round_index']}): its "
                           f"kept half belongs to the {n} workers of that step. Resume it with {n} workers, or "
                           "use a checkpoint at a step boundary (periodic checkpoints are)")
    if "two_level" in (meta0.get("topology", "flat"), topology):
        # its per-rank state (error feedback, 1-bit Adam's) covers a rail slice, not the buffer
        raise ReshardError(f"{where} was written by {n} workers and this run has {world}, under the two-level "
                           "exchange on one side: re-cutting its per-slice state is not supported yet. Resume "
                           f"with {n} workers in the same layout, or run both with topology='flat'")
    if meta0.get("outer", {}).get("unmerged"):
        raise ReshardError(f"{where} was taken with an outer round in flight (outer_overlap): resume it with "
                           f"{n} workers, or use a checkpoint taken after the round was merged")
    local = bool(plan.local_steps)
    mine = old[rank][0] if rank < n else None
    carried: dict[str, str] = {}
    dropped: list[str] = []
    out: dict[str, torch.Tensor] = {}
    theta_sync = old[0][0].get("outer.theta_sync")

    for key in old[0][0]:
        pieces = [t[key] for t, _ in old]
        if key.startswith("feedback_mark.") or key in MID_STEP:
            raise ReshardError(f"{where} holds {key!r}, state of a step in progress: resume it with {n} workers")
        if key.startswith("opt."):
            if not local:
                out[key] = _recut(pieces, numel, padded, rank, world)
                carried[key] = "re-cut"
            elif mine is not None:
                out[key] = _repad(mine[key], numel, padded)
                carried[key] = "own (local)"
            elif key == "opt.master" and theta_sync is not None:
                out[key] = _repad(theta_sync, numel, padded)
                carried[key] = "theta_sync (new worker)"
            else:
                out[key] = _repad(pieces[rank % n], numel, padded)
                carried[key] = f"old rank {rank % n}'s (new worker)"
        elif key == "onebit.server_error":
            out[key] = _recut(pieces, numel, padded, rank, world)
            carried[key] = "re-cut"
        elif key in SHARED:
            fill = True if key == "onebit.mask" else 0  # the padding never had a gradient
            out[key] = _repad(pieces[0], numel, padded, fill)
            carried[key] = "rank 0's"
        elif key in SUMMED:
            total = torch.stack([p[:numel].to(torch.float64) for p in pieces]).sum(0)
            out[key] = _repad((total / world).to(pieces[0].dtype), numel, padded)
            carried[key] = f"sum over {n} spread over {world}"
        elif key in LOCAL:
            out[key] = _repad(pieces[rank if rank < n else 0], numel, padded)
            carried[key] = "own" if rank < n else "old rank 0's (new worker)"
        elif key == "pending_grad":
            out[key] = torch.zeros(padded, dtype=pieces[0].dtype)
            dropped.append("the accumulated gradient not yet sent (dealt again)")
        elif key.startswith("rng_"):
            out[key] = pieces[rank % n]
            carried[key] = f"old rank {rank % n}'s"
        elif key.startswith("feedback."):
            continue  # below, all together
        else:
            raise ReshardError(f"{where}: no rule to re-cut {key!r} for another world size: resume with {n} workers")

    if any(k.startswith("feedback.") for k in old[0][0]):
        fresh = ctx.grads.state_dict(False)  # this engine's config (numel, group) and beta
        group = int(fresh["feedback.config"][4])
        total = torch.stack([_feedback_error({k[9:]: v for k, v in t.items() if k.startswith("feedback.")},
                                             group)[:numel].to(torch.float64) for t, _ in old]).sum(0)
        spread = _repad((total / world).to(torch.float32), numel, padded)
        out["feedback.config"], out["feedback.beta"] = fresh["feedback.config"], fresh["feedback.beta"]
        if "feedback.e" in fresh:
            out["feedback.e"] = spread
        else:
            codes, scales = make_codec("int8", group_size=group, scale_dtype=torch.float32).encode(
                spread, check_finite=False)
            out["feedback.e_codes"], out["feedback.e_scales"] = codes, scales
        carried["feedback"] = f"error sum over {n} spread over {world}"

    base = old[rank][1] if rank < n else meta0
    pending = base["pending_count"]
    meta = {**base, "rank": rank, "world_size": world, "shard_size": flat.shard_size,
            "round_index": meta0["round_index"], "step": meta0["step"], "opt_step": meta0["opt_step"],
            "consumed": base["consumed"] - pending if rank < n else 0,
            "pending_count": 0, "pending_samples": 0, "pending_loss": 0.0, "accumulation": {}}
    if any(m.get("pending_count") for _, m in old):
        dropped.append("the pending micro-batches (their round is dealt again at the new shares)")
    if meta0.get("accumulation"):
        dropped.append("measured speeds (measured again)")
    if world < n:
        dropped.append(f"workers {list(range(world, n))}'s own state"
                       + (" (their local progress since the last outer round)" if local else ""))
    return out, meta, {"carried": carried, "dropped": dropped}


def recut_rails(ctx: RoundContext, plan: RoundPlan, old: list[tuple[dict, dict]], where: str) -> tuple[dict, dict, dict]:
    """Resume a node-sharded checkpoint at another number of nodes: the state of rank (m, l) is
    chunk m of rail l's local buffer, so each rail's old files are re-cut for the new rail by
    ``recut`` (the flat rules above, M ranks for N). The ranks per node must stay: the local
    buffers are cut by them."""
    meta0, layout = old[0][1], ctx.dims.layout
    saved, here = meta0.get("model_sharding", "none"), ctx.cfg.model_sharding
    if saved != here:
        raise ReshardError(f"{where} was written with model_sharding={saved!r} and this run has {here!r}: resume "
                           f"with model_sharding={saved!r}")
    g_old, g = meta0["ranks_per_node"], layout.ranks_per_node
    if g_old != g:
        raise ReshardError(f"{where} was written by a model_sharding='node' run of {g_old} ranks per node and this "
                           f"run has {g}: the local shards are cut by the node's ranks, so only another number of "
                           f"nodes is re-cut. Resume with {g_old} ranks per node (LOCAL_WORLD_SIZE / ranks_per_node)")
    rail = [(t, {**m, "model_sharding": "none"}) for t, m in old[layout.local::g]]
    view = SimpleNamespace(comm=SimpleNamespace(rank=layout.node, world_size=layout.nodes), flat=ctx.flat,
                           grads=ctx.grads, cfg=SimpleNamespace(model_sharding="none"))
    tensors, meta, report = recut(view, plan, "flat", rail, where)
    meta.update(rank=ctx.comm.rank, world_size=ctx.comm.world_size, model_sharding=here, ranks_per_node=g)
    return tensors, meta, report
