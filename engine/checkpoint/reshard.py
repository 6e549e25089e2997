"""Resume at another world size: re-cut the state of N workers' checkpoint files for N' workers.

Every rank of the new run reads all N rank files (verified as usual) and builds the state dict its
``Engine.load_state_dict`` takes (docs/elastic.md, "Checkpoints"). The strategy says how each of
its tensors is re-cut (``Strategy.recut_rules``: shard, shared, summed, local, step;
engine/strategies/base.py ``Recut``); this module applies the rules and knows the engine's own
tensors:

  feedback.*    the gradient reducer's error feedback: the sum over the old workers is kept and
                spread evenly, sum / N' on every new worker. What the workers owe the model is
                that sum (the next reduce adds every worker's error once); no worker's error
                belongs to a coordinate range, so an even spread is the one split that neither
                drops a departed worker's debt nor favours a survivor
  pending_grad  the accumulated gradient not yet sent: dropped (its micro-batches are dealt again
                at the new shares, so the data position is kept: ``consumed`` steps back by them)
  rng_*         new rank r takes old rank r mod N's
  measured speeds are dropped (measured again)

With optimizer='muon' the parameters' places in the buffer depend on the world size (under
model_sharding='node': on the number of nodes): every tensor is read in model order by the old
placement and written at the new one (recut_matrices.py).

A checkpoint between the rounds of a step, or one whose strategy refuses (``recut_refusal``: an
ACCO kept half, an outer round in flight), cannot be re-cut: resume it at its own world size, or
from a checkpoint at a step boundary (periodic checkpoints are).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from acco_loco.registry import make_codec

from ..core.rounds import RoundContext
from .recut_matrices import ModelOrder, matrix_order

log = logging.getLogger("acco_loco")


class ReshardError(ValueError):
    pass


def _feedback_error(fb: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """One old worker's error-feedback error as fp32 (decoded from int8 storage)."""
    if "e" in fb:
        return fb["e"].to(torch.float32)
    codec = make_codec("int8", group_size=group_size, scale_dtype=torch.float32)
    return codec.decode(fb["e_codes"], fb["e_scales"])


def apply_rule(rule, key: str, old: list[dict[str, torch.Tensor]], order: ModelOrder, shard: int, rank: int,
               world: int) -> tuple[torch.Tensor, str]:
    """(this rank's tensor, how it was carried) for ``key`` under ``rule`` (a ``Recut``): the old
    tensors read in model order and placed in the new layout by ``order``; ``shard``: the new shard size."""
    n, pieces = len(old), [t[key] for t in old]
    if rule.rule == "shard":
        full = order.place(order.values(torch.cat(pieces)))
        return full[rank * shard:(rank + 1) * shard].clone(), "re-cut"
    if rule.rule == "shared":
        return order.place(order.values(pieces[0]), rule.fill), "rank 0's"
    if rule.rule == "summed":
        total = torch.stack([order.values(p).to(torch.float64) for p in pieces]).sum(0)
        return order.place((total / world).to(pieces[0].dtype)), f"sum over {n} spread over {world}"
    if rank < n:  # local
        return order.place(order.values(pieces[rank]), rule.fill), "own"
    if rule.new_from is not None and rule.new_from in old[0]:
        return (order.place(order.values(old[0][rule.new_from]), rule.fill),
                f"old rank 0's {rule.new_from} (new worker)")
    return order.place(order.values(pieces[rank % n]), rule.fill), f"old rank {rank % n}'s (new worker)"


def recut(ctx: RoundContext, strategy, topology: str, old: list[tuple[dict[str, torch.Tensor], dict]],
          where: str, who: str = "workers", order: ModelOrder | None = None) -> tuple[dict, dict, dict]:
    """(tensors, meta) for this rank (``ctx``: its comm, flat buffer and gradient reducer;
    ``strategy`` and ``topology``: the new run's) from the N old ranks' (tensors, meta), and a
    report {carried, dropped} for the log; ``who``: what the N are called in its messages (a rail's: nodes);
    ``order``: the old and new placements, when the caller built them (a rail's Muon matrices)."""
    if ctx.cfg.model_sharding != "none" or old[0][1].get("model_sharding", "none") != "none":
        return recut_rails(ctx, strategy, old, where)  # each rail's chunks re-cut as a flat run's shards
    n, rank, world = len(old), ctx.comm.rank, ctx.comm.world_size
    flat = ctx.flat
    numel, padded = flat.numel, flat.padded
    meta0 = old[0][1]
    if meta0["numel"] != numel:
        raise ReshardError(f"{where} holds a model of {meta0['numel']} trainable values and this engine has "
                           f"{numel}: load it into the model it was saved from")
    step_in_progress = "it was taken between the rounds of a step" if meta0["round_index"] % \
        strategy.plan.rounds_per_step else None
    refused = step_in_progress or strategy.recut_refusal(meta0)
    if refused:
        raise ReshardError(f"{where} cannot be re-cut for {world} {who}: {refused} (round {meta0['round_index']}). "
                           f"Resume it with {n} {who}, or use a checkpoint at a step boundary (periodic "
                           "checkpoints are)")
    if "two_level" in (meta0.get("topology", "flat"), topology):
        # its per-rank state (error feedback, 1-bit Adam's) covers a rail slice, not the buffer
        raise ReshardError(f"{where} was written by {n} workers and this run has {world}, under the two-level "
                           "exchange on one side: re-cutting its per-slice state is not supported yet. Resume "
                           f"with {n} workers in the same layout, or run both with topology='flat'")
    # the old tensors read in model order, then placed for this run (Muon's whole matrices move: recut_matrices.py)
    if order is None:
        order = matrix_order(ctx, n) if getattr(flat, "matrices", None) else ModelOrder(numel, padded)
    if getattr(order, "old_shard_size", meta0["shard_size"]) != meta0["shard_size"]:
        raise ReshardError(f"{where} holds shards of {meta0['shard_size']} values, but placing this model's matrices "
                           f"for its {n} workers gives {order.old_shard_size}: it was written with another model, "
                           "align or codec group. Resume with the model and configuration it was saved with")
    carried: dict[str, str] = {}
    dropped: list[str] = []
    out: dict[str, torch.Tensor] = {}
    olds = [t for t, _ in old]

    for key in old[0][0]:
        if key.startswith("feedback_mark."):
            raise ReshardError(f"{where} holds {key!r}, state of a step in progress: resume it with {n} workers")
        if key == "pending_grad":
            out[key] = torch.zeros(padded, dtype=old[0][0][key].dtype)
            dropped.append("the accumulated gradient not yet sent (dealt again)")
        elif key.startswith("rng_"):
            out[key] = old[rank % n][0][key]
            carried[key] = f"old rank {rank % n}'s"
        elif key.startswith("feedback."):
            continue  # below, all together
        else:
            rule = strategy.recut_rule(key)
            if rule is None:
                raise ReshardError(f"{where}: strategy {strategy.plan.name!r} has no rule to re-cut {key!r} for "
                                   f"another world size: resume with {n} workers")
            if rule.rule == "step":
                raise ReshardError(f"{where} holds {key!r}, state of a step in progress: resume it with {n} workers")
            out[key], carried[key] = apply_rule(rule, key, olds, order, flat.shard_size, rank, world)

    if any(k.startswith("feedback.") for k in old[0][0]):
        fresh = ctx.grads.state_dict(False)  # this engine's config (numel, group) and beta
        group = int(fresh["feedback.config"][4])
        total = torch.stack([order.values(_feedback_error({k[9:]: v for k, v in t.items() if k.startswith("feedback.")},
                                                          group)).to(torch.float64) for t, _ in old]).sum(0)
        spread = order.place((total / world).to(torch.float32))
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
        dropped.append(f"{who} {list(range(world, n))}'s own state"
                       + (" (their local progress since the last outer round)" if strategy.plan.local_steps else ""))
    return out, meta, {"carried": carried, "dropped": dropped}


def recut_rails(ctx: RoundContext, strategy, old: list[tuple[dict, dict]], where: str) -> tuple[dict, dict, dict]:
    """Resume a node-sharded checkpoint at another number of nodes: the state of rank (m, l) is
    chunk m of rail l's local buffer, so each rail's old files are re-cut for the new rail by
    ``recut`` (the flat rules above, M ranks for N). The ranks per node must stay: the local
    buffers are cut by them. Under optimizer='muon' the local buffer places each parameter's rows
    for the number of nodes (recut_matrices.py), so the rail's tensors go through model order."""
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
    order = matrix_order(ctx, len(old) // g) if getattr(ctx.flat, "matrices", None) else None
    rail = [(t, {**m, "model_sharding": "none"}) for t, m in old[layout.local::g]]
    view = SimpleNamespace(comm=SimpleNamespace(rank=layout.node, world_size=layout.nodes), flat=ctx.flat,
                           grads=ctx.grads, cfg=SimpleNamespace(model_sharding="none"))
    tensors, meta, report = recut(view, strategy, "flat", rail, where, "nodes", order)
    meta.update(rank=ctx.comm.rank, world_size=ctx.comm.world_size, model_sharding=here, ranks_per_node=g)
    return tensors, meta, report
