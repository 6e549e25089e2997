"""model_sharding='node': the model sharded over each node's G ranks with torch's FSDP2, and the
engine's own exchange across nodes on each rank's local shards (docs/nodes.md, "Model sharding
inside the node").

One place applies it, as torchtitan's ``parallelize`` does: activation checkpointing on each
transformer block (``activation_checkpointing``), then ``fully_shard`` on each block and on the
root over the "local" dimension of the node x local DeviceMesh, parameters resharded after the
forward, frozen parameters sharded too. FSDP2 does the node's all-gathers (forward, backward)
and the node's gradient reduce-scatter (a sum in fp32: every rank gets its node's sum of its
local shards after each micro-batch's backward, added into the engine's gradient buffer).

Across nodes: rank (m, l)'s *local buffer* is its local shards (rows of dim 0, FSDP2's Shard(0)
cut) of every trainable parameter, concatenated in the model's order, which is the same cut on
every rank of rail l; padded to M x align it is the flat buffer of the rail's exchange (M ranks,
the reducers and gatherers of engine/parallel/collectives.py), rank (m, l) owning chunk m of it: master
and moments hold 1/(G x M) of the model. The new local buffer is written into FSDP2's local
shards by the compute side at the round boundary (``LocalShards.install``).

Threads and process groups (engine/parallel/dims.py): a process group is used by one thread only.
FSDP2's node group (the mesh's "local" group, role "node.compute") by the compute thread, which
issues every FSDP2 collective; the rail group, the world group and a node group of the comm
side's own (two small all-reduces per round: the node's micro-batch count, the new shards'
finiteness) by the comm thread. So the compute side's node collectives run beside the comm
side's rail collectives without ever sharing a group.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from acco_loco.optim import OptimizerSpec, init_state

from ..core.flat import LocalShards
from ..core.rounds import RoundContext, gather_buffer
from ..strategies import shard_groups
from .collectives import make_collectives
from .comm import resolve_chunks
from .dims import ParallelDims
from .node_matrices import NodeMatrices
from .two_level import ShardGrads, ShardParams

log = logging.getLogger("acco_loco")

# where a model's stack of transformer blocks sits (Llama-style, GPT-2, a plain stack)
BLOCK_PATHS = ("model.layers", "transformer.h", "layers", "blocks")


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard (and checkpoint) one by one: ``model.sharding_blocks`` when the user
    set it (a list of submodules, or a callable that returns one), else the first ModuleList at
    BLOCK_PATHS; [] when there is none (then the root is the one FSDP2 unit)."""
    given = getattr(model, "sharding_blocks", None)
    if given is not None:
        blocks = list(given() if callable(given) else given)
        owned = {id(m) for m in model.modules()}
        if not blocks or any(not isinstance(b, torch.nn.Module) or id(b) not in owned for b in blocks):
            raise ValueError("model.sharding_blocks must list submodules of the model (or be a callable that "
                             "returns them), e.g. model.sharding_blocks = list(model.layers)")
        return blocks
    for path in BLOCK_PATHS:
        found = model
        for part in path.split("."):
            found = getattr(found, part, None)
        if isinstance(found, torch.nn.ModuleList) and len(found):
            return list(found)
    return []


def _checkpointed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: torch.nn.Module) -> int:
    """Recompute each block's activations in the backward pass (torch.utils.checkpoint, the
    non-reentrant form, which composes with FSDP2). The block's forward is wrapped in place, so
    parameter names and checkpoints do not change. Returns the blocks wrapped."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"activation_checkpointing: no transformer blocks found in {type(model).__name__} "
                         f"(looked at {', '.join(BLOCK_PATHS)}): set model.sharding_blocks to the list of "
                         "blocks to checkpoint")
    for block in blocks:
        if not getattr(block, "_acco_checkpointed", False):
            block.forward = functools.partial(_checkpointed, block.forward)
            block._acco_checkpointed = True
    return len(blocks)


def shard_model(model: torch.nn.Module, mesh) -> int:
    """``fully_shard`` each block, then the root, over ``mesh`` (1-D: a node's ranks); FSDP2's
    gradient reduce-scatter sums in fp32 (no division: the engine weights by micro-batch
    counts). Returns the number of blocks sharded on their own."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    blocks = find_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no premultiplied sum
    return len(blocks)


def local_rows(full: torch.Tensor, g: int, local: int) -> torch.Tensor:
    """This local rank's rows of a whole parameter under FSDP2's Shard(0) cut (torch.chunk's:
    chunks of ceil(rows / G), the last ones shorter or empty)."""
    chunks = torch.chunk(full, g, dim=0) if full.dim() else (full,)
    return chunks[local] if local < len(chunks) else full[full.shape[0]:]


def local_start_values(whole32: torch.Tensor, named: list, sharded: list, g: int, local: int) -> list:
    """Each trainable parameter's local shard of rank 0's broadcast fp32 values, flattened."""
    local32, at = [], 0
    for (name, p), (_, before) in zip(sharded, named):
        rows = local_rows(whole32[at:at + before.numel()].view(before.shape), g, local)
        at += before.numel()
        if tuple(rows.shape) != tuple(p.to_local().shape):
            raise RuntimeError(f"{name}: FSDP2's local shard is {tuple(p.to_local().shape)}, the engine expected "
                               f"{tuple(rows.shape)} (torch.chunk's cut of dim 0 over {g} ranks)")
        local32.append(rows.reshape(-1))
    return local32


def local_values_from_file(model: torch.nn.Module, weights, sharded: list, g: int, local: int) -> list:
    """The sharded meta model's local shards read from the weights folder, each rank its own rows
    (engine/core/loading.py); the trainable ones' fp32 values in the model's order, flattened."""
    from ..core.loading import load_local_shards

    values = load_local_shards(model, weights, g, local)
    return [values[name] for name, _ in sharded]


def build_sharded_context(model: torch.nn.Module, named: list, whole32: torch.Tensor | None, cfg,
                          dims: ParallelDims, strategy, spec: OptimizerSpec, dtype: torch.dtype,
                          weights=None, whole: list[bool] | None = None) -> RoundContext:
    """The round context of a node-sharded run (engine/core/context.py ``build_context`` has started
    every replica from rank 0's values and cast them, or, with ``weights``, left the model on the
    meta device: each rank then reads its local shards from the folder): the model sharded with
    FSDP2 over the compute thread's node group, the local buffer and the rail's reducer and
    gatherer around it. ``whole``: the parameters Muon steps whole, each kept in one chunk
    (engine/parallel/node_matrices.py), or None."""
    layout, device = dims.layout, dims.device
    m, g = layout.nodes, layout.ranks_per_node
    blocks = shard_model(model, dims.fsdp_mesh()["local"])
    if dims.rank == 0:
        log.info("model_sharding node: FSDP2 over %d ranks per node (%s), the exchange over %d nodes on the "
                 "local shards", g, f"{blocks} blocks + root" if blocks else "the root as one unit", m)
    sharded = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if [n for n, _ in sharded] != [n for n, _ in named]:
        raise RuntimeError("FSDP2 changed the trainable parameters' names or order: "
                           f"{[n for n, _ in named]} became {[n for n, _ in sharded]}")
    local32 = (local_values_from_file(model, weights, sharded, g, layout.local) if weights is not None
               else local_start_values(whole32, named, sharded, g, layout.local))
    # without overlap the round's gradient buffer is free once reduced: the new parameters are
    # gathered into it (one buffer of the local shards' size for both); with overlap compute
    # accumulates into a second one meanwhile, and each round gathers into the one it reduced
    one = not strategy.plan.overlap or strategy.plan.local_steps > 0  # local steps read no second buffer
    flat = LocalShards([p for _, p in sharded], [n for n, _ in sharded], m,
                       math.lcm(cfg.align, *shard_groups(cfg)), dtype, grad_buffers=1 if one else 2, whole=whole)
    dims.set_chunks(resolve_chunks(cfg.comm_chunks, flat.shard_size, device))
    padded32 = flat.spread(torch.cat(local32).to(device=device, dtype=torch.float32))
    node, rail = dims.comm("node"), dims.comm("rail")
    inner_grads, inner_params = make_collectives(cfg, flat.padded, m, device, dims.rank, dtype)
    owned = strategy.initial_values(flat, padded32, layout.node, None)  # chunk m of the rail's buffer
    matrices = NodeMatrices(flat.matrices_in(layout.node), node, g, layout.local) if flat.matrices else None
    return RoundContext(cfg=cfg, comm=dims.comm("world"), flat=flat, spec=spec,
                        shard_state=init_state(owned, spec, matrices.blocks if matrices else ()),
                        grads=ShardGrads(inner_grads, node, rail, layout), node_matrices=matrices,
                        params=ShardParams(inner_params, node, rail, layout, refresh=flat.read_into if one else None),
                        # (a strategy whose parameters live in it between rounds, local_sgd's, keeps its own)
                        gather_buf=flat.grads[0] if one and not getattr(strategy, "gathered_is_state", False)
                        else gather_buffer(flat, strategy),  # overlap: None, into the reduced one
                        dims=dims)
