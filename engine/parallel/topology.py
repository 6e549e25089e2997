"""Where the ranks sit: M nodes of G ranks each, and which exchange the engine runs over them.

Users' GPUs sit G to a node behind one network link per node. The launcher says so: torchrun
and ``accelerate launch`` set LOCAL_WORLD_SIZE (G), LOCAL_RANK and GROUP_RANK (the node) and
number the ranks node by node (rank = node * G + local). ``topology`` (EngineConfig) chooses:

- ``flat``: one exchange over all N = M x G ranks (every rank's compressed rows cross the link);
- ``two_level``: a full-precision reduce-scatter inside the node, then only the node's sum
  crosses the link, each of the G ranks carrying 1/G of it over its rail (the ranks of the same
  local index on every node); parameters come back the same way in reverse;
- ``auto`` (default): two-level when there are at least 2 nodes of at least 2 ranks, else flat,
  which is the same exchange as before on one node or with one rank per node.

The groups of the two levels (a node's G ranks, a rail: one local index on every node) are made
by engine/parallel/dims.py; docs/nodes.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

TOPOLOGIES = ("auto", "flat", "two_level")


@dataclass(frozen=True)
class Layout:
    """M nodes x G ranks; this rank is ``local`` on ``node`` (rank = node * G + local). The one
    layout object: the engine's, the planner's and the benchmarks' (they leave node and local 0)."""

    nodes: int
    ranks_per_node: int = 1
    node: int = 0
    local: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"a layout needs at least 1 node of at least 1 rank, got {self.nodes} x "
                             f"{self.ranks_per_node}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer: the launcher (torchrun, accelerate launch) "
                         "sets it; unset it or fix it") from None


def ranks_per_node(configured: int | None) -> int:
    """G from the config, else the launcher's LOCAL_WORLD_SIZE, else 1 (one rank per node: the
    testbed's layout, and a launcher that does not say)."""
    g = configured if configured is not None else _env_int("LOCAL_WORLD_SIZE")
    return 1 if g is None else g


def check_node_layout(g: int, rank: int, world: int, device: torch.device, group=None) -> None:
    """Every rank must see the same G and sit where rank = node * G + local says; raise on every
    rank otherwise (one all_gather of four integers on ``group``, the world's, at start, before
    anything else can hang)."""
    local_env, node_env = _env_int("LOCAL_RANK"), _env_int("GROUP_RANK")
    mine = torch.tensor([g, rank, -1 if local_env is None else local_env, -1 if node_env is None else node_env],
                        dtype=torch.int64, device=device)
    seen = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(seen, mine, group=group)
    table = [[int(v) for v in t.cpu()] for t in seen]
    for r, (g_r, _, _, _) in enumerate(table):
        if g_r != g:
            raise ValueError(
                f"the ranks disagree on the ranks per node: rank {r} has {g_r}, rank {rank} has {g} "
                "(LOCAL_WORLD_SIZE or ranks_per_node): every node must run the same number of ranks; "
                "launch the same --nproc-per-node on every node, or set topology='flat'")
    if g > 1 and world % g == 0:
        for r, (_, _, local, node) in enumerate(table):
            if (local >= 0 and local != r % g) or (node >= 0 and node != r // g):
                raise ValueError(
                    f"rank {r} is LOCAL_RANK {local} on node (GROUP_RANK) {node}, but nodes of {g} ranks "
                    f"need rank = node * {g} + local (ranks numbered node by node, as torchrun numbers "
                    "them): launch with torchrun / accelerate launch, or set topology='flat'")


def detect_layout(g: int, rank: int, world: int, topology: str) -> Layout:
    """This rank's place in M nodes of G ranks; uneven nodes are refused unless the run is flat."""
    if g < 1 or world % g:
        if topology == "flat":
            return Layout(nodes=world, ranks_per_node=1, node=rank, local=0)
        raise ValueError(
            f"{world} ranks cannot be split into nodes of {g} ranks each (ranks_per_node / LOCAL_WORLD_SIZE): "
            "every node must run the same number of ranks; set ranks_per_node to the ranks of one node, "
            "or topology='flat'")
    return Layout(nodes=world // g, ranks_per_node=g, node=rank // g, local=rank % g)


def exchange_for(topology: str, layout: Layout) -> str:
    """'flat' or 'two_level' for this layout; a clear error where two_level cannot apply. (The
    model and config agreement of all ranks is engine/parallel/agreement.py's ``check_agreement``.)"""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}: choose one of {TOPOLOGIES}")
    two_level_fits = layout.nodes > 1 and layout.ranks_per_node > 1
    if topology == "auto":
        return "two_level" if two_level_fits else "flat"
    if topology == "two_level" and not two_level_fits:
        raise ValueError(
            f"topology='two_level' needs at least 2 nodes of at least 2 ranks; this run is {layout.nodes} "
            f"node(s) x {layout.ranks_per_node} rank(s) (ranks_per_node / LOCAL_WORLD_SIZE): use "
            "topology='flat' or 'auto'")
    return topology
