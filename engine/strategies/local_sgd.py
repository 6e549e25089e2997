"""local_sgd: every worker steps its own copy of the parameters with plain SGD on its own
gradient, and the workers average their parameters every PERIOD steps (local SGD; Stich,
"Local SGD Converges Fast and Communicates Little", arXiv 1805.09767). No sharding, no codec:
the smallest strategy that is not a ZeRO-1 round, one file plus its registry line.

With the model sharded inside the node (model_sharding="node", engine/parallel/sharding.py) a node
is one replica: FSDP2 has summed the node's gradients of each rank's local shards, each rank steps
its local shards with the node's mean gradient, and the period's average runs over the rail (the
same local rank on every node), on 1/G of the model.

With ``optimizer_offload='cpu'`` the replica's parameters (its whole state) live in host memory
and are stepped and averaged there (engine/runtime/offload.py ``HostParams``); the device holds the
compute parameters and the gradient."""

from __future__ import annotations

import math

import torch

from acco_loco.acco import RoundKind, RoundPlan
from acco_loco.schedule import lr_at

from ..core.rounds import RoundContext, RoundRequest, RoundResult
from ..runtime.host import nonfinite_flag, small_vector, to_host
from ..runtime.offload import OFFLOAD_PIECE, HostParams
from .base import Recut, Strategy
from .spec import ALIGN, MemorySpec, StrategySpec, padded, small_bytes


def spec_round_parts(numel: int, world: int, mode, ws) -> dict:
    """One step's bytes per rank, averaged over the period: the parameters' ring all-reduce in the
    compute dtype every PERIOD steps (its reduce-scatter and all-gather halves, (N-1)/N of the
    padded buffer each), and the step's small all-reduce of 3 + 3N float64 values."""
    half = (world - 1) * (padded(numel, world, ALIGN) // world) * ws.compute_bytes / LocalSGD.period
    return {"all_to_all": half, "all_gather": half, "small": small_bytes(world, 3 + 3 * world)}


class LocalSGD(Strategy):
    plan = RoundPlan("local_sgd", overlap=False, kinds=(RoundKind.COMMIT,))
    period = 4  # steps between parameter averages
    node_sharding_refused = None  # a node is one replica: its ranks step their local shards, the rail averages
    gathered_is_state = True  # ctx.gather_buf holds this replica's parameters between rounds (sharding.py)
    rail = None  # model_sharding='node': the comm thread's rail group; None: the world averages
    per_node = 1  # ranks that step one replica together (G under model sharding)
    offload_refused = None  # its state, the replica's parameters, may live in host memory
    offload: HostParams | None = None
    recut_rules = {**Strategy.recut_rules, "local_params": Recut("local", new_from="local_params")}

    @classmethod
    def spec(cls) -> StrategySpec:
        # a round every step, its average's bytes spread over the period (its H is fixed, not the
        # planner's inner_steps); its memory: every replica's own parameters, no optimizer state of its
        # own. Its step priced as the shard optimizer's per value it steps (plain SGD reads and writes less)
        return StrategySpec(rounds=1, overlap=False, memory=MemorySpec("replica"), round_parts=spec_round_parts,
                            work=lambda numel, slice_, shard, mode: {"shard_opt_s_per_param": slice_})

    @classmethod
    def check(cls, cfg) -> None:
        if (cfg.optimizer, cfg.momentum, cfg.weight_decay, cfg.codec, cfg.max_grad_norm) != ("sgd", 0.0, 0.0, "none", None) \
                or cfg.param_codec not in ("auto", "float32"):
            raise ValueError("strategy 'local_sgd' runs plain SGD on full local copies: set optimizer='sgd', "
                             "momentum=0.0, weight_decay=0.0, codec='none', param_codec='auto', max_grad_norm=None")

    def setup(self, ctx: RoundContext) -> None:
        dims = getattr(ctx, "dims", None)
        if dims is not None and dims.kind == "node_sharded":
            self.rail, self.per_node = dims.comm("rail"), dims.layout.ranks_per_node
        if ctx.cfg.optimizer_offload == "cpu":  # ctx.gather_buf (the object the loop installs) becomes the host copy
            self.offload = HostParams(ctx.gather_buf, ctx.gather_buf.device, OFFLOAD_PIECE)
            torch.utils.swap_tensors(ctx.gather_buf, self.offload.values)  # the device tensor now in .values: dropped
            self.offload.values = ctx.gather_buf

    def run_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        comm, full, n = ctx.comm, ctx.flat.grads[req.grad_index], ctx.comm.world_size
        before = comm.bytes_sent  # every engine Comm's (the rail's too: one counter)
        values: list = [req.count, req.samples, req.loss_sum] + [0.0] * (3 * n)
        values[3 + comm.rank] = float(req.exhausted)
        values[3 + n + comm.rank] = nonfinite_flag(full)  # a device flag: no host read here
        values[3 + 2 * n + comm.rank] = req.count
        small = to_host(comm.all_reduce_sum(small_vector(values, full.device)))  # the round's one host read
        count, bad = int(small[0]), [i for i in range(n) if small[3 + n + i] > 0]
        node = comm.rank // self.per_node  # ranks are numbered node by node
        replica_count = int(sum(small[3 + 2 * n + r] for r in range(node * self.per_node, (node + 1) * self.per_node)))
        lr = lr_at(req.step_index, ctx.cfg.lr, ctx.cfg.lr_schedule, ctx.cfg.warmup_steps, ctx.cfg.max_steps,
                   ctx.cfg.min_lr_ratio)
        average = comm if self.rail is None else self.rail
        if self.offload is not None:
            if not bad and replica_count:
                self.offload.sgd_step(full, replica_count, lr)
            if (req.step_index + 1) % self.period == 0:
                self.offload.average(average)
        else:
            if not bad and replica_count:  # this replica's own step (a node's: FSDP2 summed its gradients)
                ctx.gather_buf.add_(full.to(ctx.gather_buf.dtype) / replica_count, alpha=-lr)
            if (req.step_index + 1) % self.period == 0:
                average.all_reduce_sum(ctx.gather_buf).div_(average.world_size)
        return RoundResult(
            index=req.index, kind=req.kind, step_index=req.step_index, local_count=req.count, count=count,
            samples=int(small[1]), loss=float(small[2]) / count if count else math.nan, lr=lr,
            grad_norm=math.nan, skipped=bool(bad), empty=count == 0, bad_ranks=bad,
            exhausted_ranks=[i for i in range(n) if small[3 + i] > 0],
            bytes_sent=comm.bytes_sent - before)

    def state_dict(self, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict]:
        return {"local_params": ctx.gather_buf.detach().cpu().contiguous()}, {}  # replicas differ

    def load_state_dict(self, ctx: RoundContext, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        with torch.no_grad():
            ctx.gather_buf.copy_(tensors["local_params"])
        ctx.flat.install(ctx.gather_buf)
