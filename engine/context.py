"""The round context at engine start: the trainable parameters flattened into one padded buffer,
every replica started from rank 0's fp32 values, and the reducer and gatherer built around it."""

from __future__ import annotations

import logging
import math
import os

import torch

from acco_loco.optim import init_state

from .collectives import make_collectives
from .comm import init_process_group, resolve_chunks
from .cpu_memory import keep_freed_memory
from .flat import FlatParams
from .grad_dtype import gradient_travels_uncompressed, resolve_grad_dtype
from .layout import make_two_level_collectives
from .rounds import RoundContext
from .strategies import shard_groups

log = logging.getLogger("acco_loco")


def trainable_parameters(model: torch.nn.Module) -> list:
    """The (name, parameter) pairs that train; refused when there are none."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters (every requires_grad is False): "
                         "unfreeze at least one parameter")
    return named


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The floating-point parameters to ``dtype``; buffers keep theirs (``model.to(dtype)`` would
    cast Llama's rotary ``inv_freq`` to bf16 too, and every position's angle with it)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def start_process_group(named: list, cfg) -> tuple[torch.device, int, int]:
    """(the model's device, rank, world size): the device made current, and on CPU the freed-memory
    setting applied before the process group and the comm thread start."""
    device = named[0][1].device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif cfg.keep_cpu_memory:
        keep_freed_memory()
    warn_shared_elastic_store()
    return (device, *init_process_group(device, cfg.timeout_s))


def warn_shared_elastic_store() -> None:
    """torchrun's workers share the rendezvous agent's store by default; after an elastic restart
    the store still holds the last attempt's keys and a new process group can connect to a dead
    worker's address and hang (pytorch/pytorch#135712): say how to turn the sharing off."""
    if (os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        log.warning("torchrun with --max-restarts shares its rendezvous store with the workers: a restarted "
                    "run can hang creating its process groups (pytorch/pytorch#135712). Launch with "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment")


def build_context(engine, named: list) -> RoundContext:
    """``named``: the trainable (name, parameter) pairs. The strategy says which of the fp32
    values its optimizer owns (``Strategy.initial_values``: a shard, or the whole buffer)."""
    cfg, device, comm = engine.cfg, engine.device, engine.comm
    if cfg.model_sharding == "node":  # FSDP2 inside the node, the exchange on local shards
        from .sharding import build_sharded_context

        return build_sharded_context(engine, named)
    if cfg.activation_checkpointing:
        from .sharding import checkpoint_blocks

        checkpoint_blocks(engine.model)
    rank, world = comm.rank, comm.world_size
    # fp32 values of rank 0 define every replica's start and every master shard
    flat32 = torch.cat([p.detach().reshape(-1).to(torch.float32) for _, p in named])
    dtype = {"auto": named[0][1].dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.compute_dtype]
    if not dtype.is_floating_point:
        raise TypeError(f"trainable parameters must be floating point, got {dtype}")
    if cfg.compute_dtype != "auto":
        cast_parameters(engine.model, dtype)
    flat = FlatParams([p for _, p in named], [n for n, _ in named], world, math.lcm(cfg.align, *shard_groups(cfg)),
                      dtype, grad_dtype=resolve_grad_dtype(
                          cfg.grad_dtype, dtype, node_sharded=False,
                          uncompressed=gradient_travels_uncompressed(cfg.codec, engine.plan.local_steps > 0)))
    comm.chunks = resolve_chunks(cfg.comm_chunks, flat.shard_size, device)  # pieces per collective
    padded32 = torch.zeros(flat.padded, dtype=torch.float32, device=device)
    padded32[:flat32.numel()] = flat32
    comm.broadcast_(padded32, src=0)
    flat.data.copy_(padded32)
    if engine.topology == "two_level":
        grads, params = make_two_level_collectives(cfg, comm, engine.layout, flat.padded, device, dtype)
    else:
        grads, params = make_collectives(cfg, flat.padded, world, device, rank, dtype)
    two_level = engine.layout if engine.topology == "two_level" else None  # the node layout, or None: flat
    owned = engine.strategy.initial_values(flat, padded32, rank, two_level)
    return RoundContext(cfg=cfg, comm=comm, flat=flat, spec=engine.spec,
                        shard_state=init_state(owned, engine.spec), grads=grads,
                        params=params, gather_buf=flat.data.clone())  # what every replica holds
