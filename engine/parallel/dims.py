"""ParallelDims: where this rank sits (M nodes x G ranks), which exchange the run takes over them
(flat, two-level, or node-sharded), and every process group the engine uses, built in one place
with the engine's timeouts (docs/nodes.md; torchtitan's ParallelDims is the model).

The default process group is the user's: a Trainer's metric all-gathers, a logger's all-reduce,
an evaluation. The engine never issues a collective on it. It makes groups of its own, each used
by one thread, so that whatever the user's code runs between ``feed`` calls never meets an
engine collective on the same group (a gloo group used by two threads at once mixes their
messages; one used by the user and the comm thread at once hangs both). The roles:

  control       the world, used by the compute thread (the caller's): start-up checks and the
                start broadcast, checkpoints, the checkpoint cadence, the load agreement
  world         the world, used by the comm thread: the rounds of a flat exchange
  node, rail    this node's ranks and this local index on every node, used by the comm thread:
                the two-level exchange and the node-sharded exchange across nodes
  node.compute  this node's ranks, used by the compute thread: FSDP2's collectives inside the
                node (model_sharding="node") and a node replica's inner steps; with
  rail.compute  the link probe of strategy="auto" at start (engine/planner/probe.py)

Every rank asks for the same roles in the same order (each group is made by every rank of the
world, as ``new_group`` requires); a group is made on first use. Each ``Comm`` handed out
refuses a collective from a second thread (``Comm.owner``), so a new path that breaks the rule
fails at once, by name, instead of hanging.

Under NCCL each group is its own communicator with its own stream, so the user's collectives
(the default group, the compute stream) and the engine's rounds (the comm thread's groups on
the comm stream) are never queued behind each other on one communicator. What may still deadlock
is two communicators whose kernels wait on each other across GPUs in different orders; the
engine's rule: the comm thread's groups carry only the round in flight, whose kernels wait on
nothing but the round's own inputs (recorded at submission), and the compute thread's collectives
(the user's, FSDP2's, a node replica's inner steps) never wait on a round's kernels except at
install, after the round's done event; docs/gpu.md, "Collectives of two threads under NCCL".
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import Comm, LinkBytes, backend_for, group_timeout_s
from .topology import Layout, check_node_layout, detect_layout, exchange_for, ranks_per_node

log = logging.getLogger("acco_loco")

KINDS = ("flat", "two_level", "node_sharded")
# role -> (which ranks share a group: "world", "node" or "rail"; the thread that uses it)
ROLES = {
    "control": ("world", "compute"),
    "world": ("world", "comm"),
    "node": ("node", "comm"),
    "rail": ("rail", "comm"),
    "node.compute": ("node", "compute"),
    "rail.compute": ("rail", "compute"),
}


@dataclass
class _Made:
    """What ParallelDims makes as it is asked: the Comms by role, the pieces they cut into."""

    comms: dict = field(default_factory=dict)
    chunks: int = 1


@dataclass(frozen=True)
class ParallelDims:
    """The run's layout and exchange (frozen facts), and the groups made for them on first use."""

    layout: Layout
    kind: str | None  # one of KINDS (None until ``decide``)
    rank: int
    world: int
    device: torch.device
    timeout_s: float | None = None
    counter: LinkBytes = field(default_factory=LinkBytes, compare=False, repr=False)  # every Comm adds to it
    _made: _Made = field(default_factory=_Made, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"unknown parallel kind {self.kind!r}: one of {KINDS}")

    @classmethod
    def start(cls, rank: int, world: int, device: torch.device, ranks_per_node_setting: int | None = None,
              topology: str = "auto", timeout_s: float | None = None) -> "ParallelDims":
        """The layout, from the launcher's environment (LOCAL_WORLD_SIZE, LOCAL_RANK, GROUP_RANK)
        and the config's ranks_per_node and topology, checked by every rank on the control group
        before any other group is made; the exchange is ``decide``'s, once the strategy is known."""
        g = ranks_per_node(ranks_per_node_setting)
        control = None
        if world > 1:
            control = _new_groups([list(range(world))], rank, backend_for(device), timeout_s)
            check_node_layout(g, rank, world, device, control)
        dims = cls(detect_layout(g, rank, world, topology), None, rank, world, device, timeout_s)
        if control is not None:
            dims._adopt("control", control)
        return dims

    def decide(self, cfg, strategy) -> "ParallelDims":
        """These dims with the exchange decided from the config (topology, model_sharding) and what
        ``strategy`` supports (its ``two_level`` and ``node_sharding_refused``); the groups made
        so far stay."""
        return dataclasses.replace(self, kind=_kind(cfg, strategy, self.layout, self.rank))

    # ------------------------------------------------------------------ facts
    @property
    def backend(self) -> str:
        return backend_for(self.device)

    # ------------------------------------------------------------------ groups
    def comm(self, role: str, *, group_of_one: bool = False) -> Comm:
        """The engine's ``Comm`` for ``role`` (a key of ROLES), made on first use by every rank.
        A role whose group would hold one rank gets no group (its collectives are copies),
        unless ``group_of_one`` (FSDP2's mesh needs a real group)."""
        made = self._made.comms.get(role)
        if made is not None:
            return made
        if role not in ROLES:
            raise KeyError(f"unknown group role {role!r}: one of {sorted(ROLES)}")
        sets = self._rank_sets(ROLES[role][0])
        size = len(sets[0])
        if size == 1 and not group_of_one:
            return self._adopt(role, None)
        _one_process_group(self.device)
        return self._adopt(role, _new_groups(sets, self.rank, self.backend, self.timeout_s))

    def set_chunks(self, chunks: int) -> None:
        """The pieces every collective is cut into (EngineConfig.comm_chunks, resolved for the
        shard size): for the Comms handed out and those still to come."""
        self._made.chunks = chunks
        for made in self._made.comms.values():
            made.chunks = chunks

    def fsdp_mesh(self):
        """The node x local DeviceMesh FSDP2 shards over: its "local" dimension is the compute
        thread's node group (the "node" dimension, the rails, carries no FSDP2 collective)."""
        from torch.distributed.device_mesh import DeviceMesh

        m, g = self.layout.nodes, self.layout.ranks_per_node
        local = self.comm("node.compute", group_of_one=True).group
        rail = self.comm("rail", group_of_one=True).group
        return DeviceMesh.from_group([rail, local], self.device.type, mesh=torch.arange(m * g).view(m, g),
                                     mesh_dim_names=("node", "local"))

    def _rank_sets(self, span: str) -> list[list[int]]:
        """Every group of ``span`` (the world, each node, each rail), as global ranks."""
        m, g = self.layout.nodes, self.layout.ranks_per_node
        if span == "world":
            return [list(range(self.world))]
        if span == "node":
            return [list(range(n * g, (n + 1) * g)) for n in range(m)]
        return [list(range(local, m * g, g)) for local in range(g)]

    def _adopt(self, role: str, group) -> Comm:
        lay, span = self.layout, ROLES[role][0]
        if span == "world":
            rank, size, peers = self.rank, self.world, [lay.node_of(r) for r in range(self.world)]
        elif span == "node":
            rank, size, peers = lay.local, lay.ranks_per_node, [0] * lay.ranks_per_node
        else:
            rank, size, peers = lay.node, lay.nodes, list(range(lay.nodes))
        made = self._made.comms[role] = Comm(rank, size, self._made.chunks, group=group, peer_nodes=peers,
                                             counter=self.counter, name=role)
        return made


def load_group(world: int, device: torch.device, timeout_s: float | None):
    """A world group of the compute thread's for the one collective step before an engine (and
    its ParallelDims) exists: a checkpoint's files listed and fetched from peers (Engine.load,
    engine/checkpoint/load.py). The caller destroys it when done."""
    return _new_groups([list(range(world))], dist.get_rank(), backend_for(device), timeout_s)


def _new_groups(sets: list[list[int]], rank: int, backend: str, timeout_s: float | None):
    """Every group of ``sets`` made (by every rank, in one order, as new_group requires) with the
    engine's timeout; returns this rank's."""
    options = {} if timeout_s is None else {"timeout": timedelta(seconds=group_timeout_s(backend, timeout_s))}
    mine = None
    for ranks in sets:
        grp = dist.new_group(ranks, **options)
        if rank in ranks:
            mine = grp
    return mine


def _kind(cfg, strategy, layout: Layout, rank: int) -> str:
    """flat, two_level or node_sharded: the checks topology and model sharding each need."""
    if cfg.model_sharding == "node":
        cfg.check_model_sharding()  # the strategy "auto" has resolved by now
        exchange_for("two_level" if cfg.topology == "two_level" else "auto", layout)
        return "node_sharded"
    kind = exchange_for(cfg.topology, layout)
    if kind == "two_level" and not strategy.two_level:
        if cfg.topology == "two_level":
            raise ValueError(f"strategy {cfg.strategy!r} has no two-level exchange yet (the sharded strategies "
                             "zero1, dpu, acco and onebit_adam have it, and diloco and sparseloco as node replicas): "
                             "use topology='flat' or 'auto'")
        if rank == 0:
            log.info("topology auto: %s runs its flat exchange over %d nodes x %d ranks",
                     cfg.strategy, layout.nodes, layout.ranks_per_node)
        return "flat"
    if rank == 0 and kind == "two_level":
        log.info("topology: two_level over %d nodes x %d ranks", layout.nodes, layout.ranks_per_node)
    return kind


def _one_process_group(device: torch.device) -> None:
    """FSDP2 and DeviceMesh need a process group even for one process without a launcher."""
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
