"""local_sgd: every worker steps its own copy of the parameters with plain SGD on its own
gradient, and the workers average their parameters every PERIOD steps (local SGD; Stich,
"Local SGD Converges Fast and Communicates Little", arXiv 1805.09767). No sharding, no codec:
the smallest strategy that is not a ZeRO-1 round, one file plus its registry line."""

from __future__ import annotations

import math

import torch

from acco_loco.acco import RoundKind, RoundPlan
from acco_loco.schedule import lr_at

from ..core.rounds import RoundContext, RoundRequest, RoundResult
from ..runtime.host import nonfinite_flag, small_vector, to_host
from .base import Recut, Strategy


class LocalSGD(Strategy):
    plan = RoundPlan("local_sgd", overlap=False, kinds=(RoundKind.COMMIT,))
    period = 4  # steps between parameter averages
    node_sharding_refused = "it averages full local copies, and has no two-level exchange"
    recut_rules = {**Strategy.recut_rules, "local_params": Recut("local", new_from="local_params")}

    @classmethod
    def check(cls, cfg) -> None:
        if (cfg.optimizer, cfg.momentum, cfg.weight_decay, cfg.codec, cfg.max_grad_norm) != ("sgd", 0.0, 0.0, "none", None) \
                or cfg.param_codec not in ("auto", "float32"):
            raise ValueError("strategy 'local_sgd' runs plain SGD on full local copies: set optimizer='sgd', "
                             "momentum=0.0, weight_decay=0.0, codec='none', param_codec='auto', max_grad_norm=None")

    def run_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        comm, full, n = ctx.comm, ctx.flat.grads[req.grad_index], ctx.comm.world_size
        before = comm.bytes_sent
        values: list = [req.count, req.samples, req.loss_sum] + [0.0] * (2 * n)
        values[3 + comm.rank] = float(req.exhausted)
        values[3 + n + comm.rank] = nonfinite_flag(full)  # a device flag: no host read here
        small = to_host(comm.all_reduce_sum(small_vector(values, full.device)))  # the round's one host read
        count, bad = int(small[0]), [i for i in range(n) if small[3 + n + i] > 0]
        lr = lr_at(req.step_index, ctx.cfg.lr, ctx.cfg.lr_schedule, ctx.cfg.warmup_steps, ctx.cfg.max_steps,
                   ctx.cfg.min_lr_ratio)
        if not bad and req.count:
            ctx.gather_buf.add_(full.to(ctx.gather_buf.dtype) / req.count, alpha=-lr)  # this worker's own step
        if (req.step_index + 1) % self.period == 0:
            comm.all_reduce_sum(ctx.gather_buf).div_(n)
        return RoundResult(
            index=req.index, kind=req.kind, step_index=req.step_index, local_count=req.count, count=count,
            samples=int(small[1]), loss=float(small[2]) / count if count else math.nan, lr=lr,
            grad_norm=math.nan, skipped=bool(bad), empty=count == 0, bad_ranks=bad,
            exhausted_ranks=[i for i in range(n) if small[3 + i] > 0], bytes_sent=comm.bytes_sent - before)

    def state_dict(self, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict]:
        return {"local_params": ctx.gather_buf.detach().cpu().contiguous()}, {}  # replicas differ

    def load_state_dict(self, ctx: RoundContext, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        with torch.no_grad():
            ctx.gather_buf.copy_(tensors["local_params"])
            ctx.flat.data.copy_(ctx.gather_buf)
