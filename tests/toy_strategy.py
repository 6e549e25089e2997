"""Toy strategies added from outside the package, each one file's class plus a registry line,
reading their own config section (tests/toy_section.py, registered beside them):

    engine.strategies.SECTIONS["toy"] = "tests.toy_section:ToyConfig"
    engine.strategies.STRATEGIES["toy_sync_sgd"] = "tests.toy_strategy:ToySyncSGD"

- toy_sync_sgd brings a loop of its own (ToyLoop): every round all-reduces the workers' summed
  fp32 gradients, and then the compute side, in the loop (not the comm thread), steps every
  replica's full copy with plain SGD of step ``toy_factor`` on the mean micro-batch gradient. No
  shards, no codec: plain DDP's shape, which neither built-in loop has (they step on the comm
  side). tests/engine/test_toy_strategy.py trains it against a float64 reference.
- toy_zero1 is zero1's rounds plus the section's settings, which it keeps
  (tests/engine/test_strategy_sections.py)."""

from __future__ import annotations

import math

import torch

from acco_loco.acco import RoundKind, RoundPlan
from engine.core.rounds import RoundContext, RoundRequest, RoundResult
from engine.loops.base import RoundLoop
from engine.strategies.base import Strategy
from engine.strategies.spec import ALIGN, MemorySpec, StrategySpec, padded, small_bytes
from engine.strategies.zero1 import Zero1


class ToyLoop(RoundLoop):
    """Every boundary: one round, waited for; the step is taken here, on the compute side. It
    submits and records through RoundLoop's ``submit_round`` and ``record``, as the built-in
    loops do."""

    def boundary(self, exhausted: bool) -> bool:
        p = self.parts
        st = p.state
        req = self.request(exhausted)
        result = self.wait(self.submit_round(req))
        self.measure(result)
        if result.count:
            p.strategy.step(p.ctx, result)
            st.step += 1
        p.flat.grads[p.flat.active].zero_()
        st.start_accumulator(p.device)
        stop = False
        if result.count:  # after the accumulator restarts: a periodic checkpoint may follow
            stop = self.record(step=st.step, loss=result.loss, lr=result.lr, samples=result.samples,
                               micro_batches=req.count, global_micro_batches=result.count,
                               grad_norm=result.grad_norm, skipped=False, bad_ranks=[],
                               min_micro_batches=req.count)
        return stop or bool(result.exhausted_ranks) or p.run.at_end(st.step)

    def drain(self) -> bool:
        return False  # nothing is ever left in flight


def toy_round_parts(numel: int, world: int, mode, ws) -> dict:
    """One round's bytes per rank: a ring all-reduce of the fp32 gradient (2 (N-1)/N of it, which
    crosses each node boundary as a ring all-gather does) and the small all-reduce of 3 + N values."""
    summed = 2 * (world - 1) * padded(numel, world, ALIGN) * 4 // world
    return {"all_to_all": 0, "all_gather": summed, "small": small_bytes(world, 3 + world)}


class ToySyncSGD(Strategy):
    plan = RoundPlan("toy_sync_sgd", overlap=False, kinds=(RoundKind.COMMIT,))
    sections = ("toy",)  # its step size is the toy section's toy_factor

    @classmethod
    def spec(cls) -> StrategySpec:  # what python -m engine.plan reads: one round, every replica whole
        return StrategySpec(rounds=1, overlap=False, memory=MemorySpec("replicated"), round_parts=toy_round_parts)

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.codec != "none" or cfg.accumulation != "fixed":
            raise ValueError("strategy 'toy_sync_sgd' sums fp32 gradients over a fixed batch: set codec='none' "
                             "and accumulation='fixed'")

    def make_loop(self, parts):
        return ToyLoop(parts)

    def initial_values(self, flat, full32, rank, layout):
        return full32  # every replica steps its own full copy

    def run_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        comm, grad, n = ctx.comm, ctx.flat.grads[req.grad_index], ctx.comm.world_size
        before = comm.bytes_sent
        small = torch.zeros(3 + n, dtype=torch.float64)
        small[0], small[1], small[2] = req.count, req.samples, req.loss_sum.to(torch.float64)
        small[3 + comm.rank] = float(req.exhausted)
        small = comm.all_reduce_sum(small)
        self.summed = comm.all_reduce_sum(grad.to(torch.float32).clone())
        count = int(small[0])
        return RoundResult(index=req.index, kind=req.kind, step_index=req.step_index, local_count=req.count,
                           count=count, samples=int(small[1]), loss=float(small[2]) / max(count, 1),
                           lr=ctx.cfg.toy_factor, grad_norm=math.nan, skipped=False, empty=count == 0,
                           bad_ranks=[], exhausted_ranks=[r for r in range(n) if small[3 + r] > 0],
                           bytes_sent=comm.bytes_sent - before)

    def step(self, ctx: RoundContext, result: RoundResult) -> None:
        master = ctx.shard_state.master
        master.add_(self.summed / result.count, alpha=-ctx.cfg.toy_factor)
        with torch.no_grad():
            ctx.flat.data.copy_(master)


class ToyZero1(Zero1):
    sections = ("toy",)  # the config sections it reads

    def __init__(self, factor: float = 1.0, mode: str = "plain") -> None:
        self.factor, self.mode = factor, mode

    @classmethod
    def from_config(cls, cfg) -> "ToyZero1":
        return cls(cfg.toy_factor, cfg.toy_mode)
