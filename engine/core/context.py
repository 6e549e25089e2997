"""The round context at engine start, built from explicit parts (the model, the config, the
ParallelDims, the strategy): every replica started from rank 0's fp32 values (or from a weights
folder every rank reads itself: engine/core/loading.py), the parameters
cast to the compute dtype, the trainable parameters flattened into one padded buffer (or, under
model_sharding="node", FSDP2's local shards: engine/parallel/sharding.py), and the reducer and gatherer
built around it."""

from __future__ import annotations

import logging
import math
import os

import torch

from acco_loco.optim import OptimizerSpec, init_state

from ..parallel.collectives import make_collectives
from ..parallel.comm import init_process_group, resolve_chunks
from ..parallel.dims import ParallelDims
from ..parallel.two_level import TwoLevelGrads, TwoLevelParams
from ..runtime.cpu_memory import keep_freed_memory
from ..strategies import shard_groups
from .dtypes import gradient_travels_uncompressed, resolve_compute_dtype, resolve_grad_dtype
from .flat import FlatParams
from .loading import WeightsLoad, pretrained_engine, start_weights  # noqa: F401 (pretrained_engine: Engine's)
from .rounds import RoundContext, gather_buffer

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


def start_rank(model: torch.nn.Module, cfg, weights, device) -> tuple:
    """(device, rank, world size, the trainable (name, parameter) pairs, the WeightsLoad or None):
    where the start values come from settled first (``weights``: a folder checked against the
    model and, unsharded, read whole by this rank: engine/core/loading.py), then the process group
    on the device the values are on (``device`` for a model built on the meta device)."""
    named = trainable_parameters(model)
    plan = start_weights(model, cfg, weights, device)  # keeps each Parameter object: ``named`` holds
    return (*start_process_group(named, cfg, plan.device if plan is not None else None), named, plan)


def start_process_group(named: list, cfg, device: torch.device | None = None) -> tuple[torch.device, int, int]:
    """(the model's device, rank, world size): the device made current, and on CPU the freed-memory
    setting applied before the process group and the comm thread start. ``device``: where a model
    built on the meta device is loaded (engine/core/loading.py), in place of its parameters'."""
    device = device if device is not None else named[0][1].device
    if device.type == "meta":
        raise ValueError("the model is on the meta device (no values): Engine(model, cfg, weights=<a save_pretrained "
                         "folder>) or Engine.from_pretrained(folder, cfg) has every rank read its own")
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


def hidden_matrices(model: torch.nn.Module, named: list) -> list[bool]:
    """Which trainable parameters Muon steps (optimizer='muon'): the 2-D weights of the hidden
    layers. Not an embedding's (an ``nn.Embedding``, also when tied as the head), not the output
    head (``get_output_embeddings()``, or a name with "lm_head"): those, and every 1-D parameter,
    take AdamW's step, as Muon is used in practice (Jordan et al. 2024; Moonlight, arXiv 2502.16982)."""
    out_of = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is not None and getattr(head, "weight", None) is not None:
        out_of.add(id(head.weight))
    return [p.ndim == 2 and id(p) not in out_of and "lm_head" not in name for name, p in named]


def start_values(named: list, dims: ParallelDims) -> torch.Tensor:
    """Rank 0's trainable values in fp32, broadcast on the control group and written into every
    rank's parameters: every replica's start and every master shard are cut from them."""
    whole32 = torch.cat([p.detach().reshape(-1).to(torch.float32) for _, p in named])
    dims.comm("control").broadcast_(whole32, src=0)
    with torch.no_grad():
        at = 0
        for _, p in named:
            p.copy_(whole32[at:at + p.numel()].view(p.shape))
            at += p.numel()
    return whole32


def loaded_values(named: list) -> torch.Tensor:
    """The trainable values every rank read from the same weights folder itself, in fp32: no
    broadcast (engine/core/loading.py)."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for _, p in named])


def build_context(model: torch.nn.Module, named: list, cfg, dims: ParallelDims, strategy,
                  spec: OptimizerSpec, weights: WeightsLoad | None = None) -> RoundContext:
    """``named``: the trainable (name, parameter) pairs. The strategy says which of the fp32
    values its optimizer owns (``Strategy.initial_values``: a shard, or the whole buffer).
    ``weights``: every rank reads its start values from that folder instead of rank 0's being
    broadcast: already loaded whole (model_sharding="none"), or, node-sharded, each rank's local
    shards read once FSDP2 has cut the meta model."""
    node_sharded = dims.kind == "node_sharded"
    if weights is None:
        whole32 = start_values(named, dims)
    elif node_sharded:
        whole32 = None  # no rank holds the whole model: build_sharded_context reads the local shards
    else:
        if not weights.loaded:
            raise RuntimeError("the weights folder must be read whole before the context is built (load_whole)")
        whole32 = loaded_values(named)
    dtype = resolve_compute_dtype(cfg.compute_dtype, named[0][1].dtype)
    grad_dtype = resolve_grad_dtype(cfg.grad_dtype, dtype, node_sharded=node_sharded,
                                    uncompressed=gradient_travels_uncompressed(cfg.codec, strategy.plan.local_steps > 0))
    if cfg.compute_dtype != "auto":
        cast_parameters(model, dtype)
    if cfg.activation_checkpointing:
        from ..parallel.sharding import checkpoint_blocks

        checkpoint_blocks(model)
    whole = hidden_matrices(model, named) if spec.name == "muon" else None  # kept in one shard each
    if node_sharded:  # FSDP2 inside the node, the exchange on local shards
        from ..parallel.sharding import build_sharded_context

        return build_sharded_context(model, named, whole32, cfg, dims, strategy, spec, dtype, weights, whole)
    comm = dims.comm("world")
    flat = FlatParams([p for _, p in named], [n for n, _ in named], dims.world,
                      math.lcm(cfg.align, *shard_groups(cfg)), dtype, grad_dtype=grad_dtype, whole=whole)
    dims.set_chunks(resolve_chunks(cfg.comm_chunks, flat.shard_size, dims.device))  # pieces per collective
    padded32 = flat.spread(whole32)
    flat.data.copy_(padded32)
    two_level = dims.layout if dims.kind == "two_level" else None  # the node layout, or None: flat
    if two_level is not None:
        # the flat reducer and gatherer built for one rail (P/G values over M ranks), wrapped by the node's level
        g, m = two_level.ranks_per_node, two_level.nodes
        inner_grads, inner_params = make_collectives(cfg, flat.padded // g, m, dims.device, dims.rank, dtype)
        node, rail = dims.comm("node"), dims.comm("rail")
        grads = TwoLevelGrads(inner_grads, node, rail, two_level)
        params = TwoLevelParams(inner_params, node, rail, two_level)
    else:
        grads, params = make_collectives(cfg, flat.padded, dims.world, dims.device, dims.rank, dtype)
    owned = strategy.initial_values(flat, padded32, dims.rank, two_level)
    matrices = flat.matrices_in(dims.rank)  # the strategies Muon runs with own shard ``rank``
    return RoundContext(cfg=cfg, comm=comm, flat=flat, spec=spec, shard_state=init_state(owned, spec, matrices),
                        grads=grads,
                        params=params, gather_buf=gather_buffer(flat, strategy), dims=dims)  # (None: the gradient's)
