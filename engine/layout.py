"""The engine's side of the layout: which exchange a run takes (engine/topology.py) and the
reducer and gatherer it builds for it (engine/collectives.py, engine/two_level.py)."""

from __future__ import annotations

import logging

import torch

from .collectives import make_collectives
from .comm import Comm
from .topology import Layout, build_groups, check_node_layout, detect_layout, exchange_for, ranks_per_node
from .two_level import TwoLevelGrads, TwoLevelParams

log = logging.getLogger("acco_loco")


def choose_topology(cfg, strategy, rank: int, world: int, device: torch.device) -> tuple[Layout, str]:
    """(the layout, 'flat' or 'two_level'); every rank checks that all agree on the layout."""
    g = ranks_per_node(cfg.ranks_per_node)
    if world > 1:
        check_node_layout(g, rank, world, device)
    layout = detect_layout(g, rank, world, cfg.topology)
    topology = exchange_for(cfg.topology, layout)
    if topology == "two_level" and not strategy.two_level:
        if cfg.topology == "two_level":
            raise ValueError(f"strategy {cfg.strategy!r} has no two-level exchange yet (the sharded strategies "
                             "zero1, dpu, acco and onebit_adam have it, and diloco and sparseloco as node replicas): "
                             "use topology='flat' or 'auto'")
        topology = "flat"
        if rank == 0:
            log.info("topology auto: %s runs its flat exchange over %d nodes x %d ranks",
                     cfg.strategy, layout.nodes, layout.ranks_per_node)
    elif rank == 0 and layout.ranks_per_node > 1 and layout.nodes > 1:
        log.info("topology: %s over %d nodes x %d ranks", topology, layout.nodes, layout.ranks_per_node)
    return layout, topology


def make_two_level_collectives(cfg, world_comm: Comm, layout: Layout, padded: int, device: torch.device,
                               dtype: torch.dtype):
    """(gradient reducer, parameter gatherer) of the two-level exchange: the flat ones built for
    one rail (P/G values over M ranks), wrapped by the node's level."""
    groups = build_groups(layout, device, cfg.timeout_s)
    g, m = layout.ranks_per_node, layout.nodes
    node = Comm(layout.local, g, world_comm.chunks, group=groups.node_group, peer_nodes=[0] * g,
                counter=world_comm.counter)
    rail = Comm(layout.node, m, world_comm.chunks, group=groups.rail_group, peer_nodes=list(range(m)),
                counter=world_comm.counter)
    grads, params = make_collectives(cfg, padded // g, m, device, world_comm.rank, dtype)
    return TwoLevelGrads(grads, node, rail, layout), TwoLevelParams(params, node, rail, layout)
