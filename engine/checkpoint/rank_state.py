"""A rank's whole training state as (tensors, JSON-able metadata), assembled from its owners:
the counters (EngineState), the optimizer's shard, the pending gradient, the RNG, the gradient
reducer's error state, the batch pacing and what the strategy keeps between rounds."""

from __future__ import annotations

import torch

from ..core.counters import EngineState
from ..core.rounds import RoundContext


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous()


def _named(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors an owner saved under ``prefix``, by its own names."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def gather_state(ctx: RoundContext, strategy, counters: EngineState, accumulation, device: torch.device,
                 topology: str) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's state from its owners: ``ctx`` (the shard, the pending gradient, the reducer's
    error state), ``strategy`` (what it keeps between rounds), ``counters``, ``accumulation``
    (measured speeds); ``topology`` ('flat' or 'two_level') is recorded for a re-cut."""
    state, flat = ctx.shard_state, ctx.flat
    opt_tensors, opt_meta = state.state_dict()
    tensors = {f"opt.{k}": _cpu(v) for k, v in opt_tensors.items()}
    tensors["pending_grad"] = _cpu(flat.grads[flat.active])
    tensors["rng_cpu"] = torch.get_rng_state()
    if device.type == "cuda":
        tensors["rng_cuda"] = torch.cuda.get_rng_state(device)
    mid_step = counters.round_index % strategy.plan.rounds_per_step != 0
    tensors.update({k: _cpu(v) for k, v in ctx.grads.state_dict(mid_step).items()})
    strategy_tensors, strategy_meta = strategy.state_dict(ctx)
    tensors.update(strategy_tensors)
    meta = {"rank": ctx.comm.rank, "world_size": ctx.comm.world_size, "topology": topology,
            **counters.state_dict(),
            "opt_step": opt_meta["step"], "shard_size": flat.shard_size, "numel": flat.numel,
            "accumulation": accumulation.state_dict(), **strategy_meta}
    if ctx.cfg.model_sharding != "none":  # the state is cut by the node's ranks: engine/parallel/sharding.py
        meta.update(model_sharding=ctx.cfg.model_sharding, ranks_per_node=ctx.dims.layout.ranks_per_node)
    return tensors, meta


def restore_state(ctx: RoundContext, strategy, counters: EngineState, accumulation, worker,
                  device: torch.device, tensors: dict[str, torch.Tensor], meta: dict, where: str) -> None:
    """Give each owner its part of what ``gather_state`` returned; ``worker`` (the comm side)
    adopts the restored tensors it may keep."""
    flat, dev = ctx.flat, device
    tensors = {k: v.to(dev) for k, v in tensors.items()}  # once, for every part below
    # the comm side keeps some of these (a resumed ACCO kept half) and frees them there
    worker.adopt(tensors.values())
    check_sharding(ctx, meta, where)
    if meta["shard_size"] != flat.shard_size or meta["numel"] != flat.numel:
        raise ValueError(f"{where} holds a shard of {meta['shard_size']} values for a model of "
                         f"{meta['numel']} trainable values; this engine has {flat.shard_size} and "
                         f"{flat.numel}: same model, same trainable parameters and align are needed")
    ctx.shard_state.load_state_dict(_named(tensors, "opt."), {"step": meta["opt_step"]})
    with torch.no_grad():
        if ctx.gather_buf is not None:  # None: each round gathers into its reduced gradient buffer, refilled then
            flat.read_into(ctx.gather_buf)  # (first: a node-sharded zero1 gathers into its gradient buffer)
        flat.grads[flat.active].copy_(tensors["pending_grad"])
    ctx.grads.load_state_dict(tensors, where)
    torch.set_rng_state(tensors["rng_cpu"].cpu())
    if "rng_cuda" in tensors and dev.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng_cuda"].cpu(), dev)
    counters.load_state_dict(meta, dev)
    accumulation.load_state_dict(meta.get("accumulation", {}))
    strategy.load_state_dict(ctx, tensors, meta)


def check_sharding(ctx: RoundContext, meta: dict, where: str) -> None:
    """A node-sharded rank's state is a chunk of its local shards' buffer, cut by the ranks per
    node: it resumes only as a node-sharded run with the same ranks per node."""
    saved = meta.get("model_sharding", "none"), meta.get("ranks_per_node")
    here = ctx.cfg.model_sharding, None if ctx.cfg.model_sharding == "none" else ctx.dims.layout.ranks_per_node
    if saved[0] == here[0] == "none":
        return
    if saved[0] != here[0]:
        raise ValueError(f"{where} was written with model_sharding={saved[0]!r} and this run has {here[0]!r}: "
                         f"resume with model_sharding={saved[0]!r}")
    if saved[1] != here[1]:
        raise ValueError(f"{where} was written by a model_sharding='node' run of {saved[1]} ranks per node and this "
                         f"run has {here[1]}: its state is cut by the node's ranks; resume with {saved[1]} ranks per "
                         "node (LOCAL_WORLD_SIZE / ranks_per_node); another number of nodes is re-cut")
