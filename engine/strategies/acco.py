"""acco: two rounds per step (Nabli et al., ACCO, arXiv 2406.02613). The estimate round steps
from theta_t with the first half's gradient (state untouched) so compute goes on from the
estimate; the commit round steps from theta_t with both halves. Each half is sent once: the
owner keeps the reduced estimate half and adds it in the commit round (acco_loco/acco.py)."""

from __future__ import annotations

import torch

from acco_loco.acco import PLANS, KeptHalf, RoundKind

from ..rounds import RoundContext, RoundRequest
from .sharded import RoundTotals, ShardedStrategy


class Acco(ShardedStrategy):
    plan = PLANS["acco"]

    def __init__(self) -> None:
        self.kept: KeptHalf | None = None  # the reduced estimate half, until its commit round
        self.kept_buf: torch.Tensor | None = None  # its values: ACCO's own buffer, one shard long

    def setup(self, ctx: RoundContext) -> None:
        self.kept_buf = torch.empty_like(ctx.shard_state.master)

    def reduce_into(self, req: RoundRequest) -> torch.Tensor | None:
        return self.kept_buf if req.kind is RoundKind.ESTIMATE else None

    def carried(self, req: RoundRequest) -> KeptHalf | None:
        return self.kept if req.kind is RoundKind.COMMIT else None

    def keep(self, req: RoundRequest, grad_sum: torch.Tensor, totals: RoundTotals) -> None:
        if req.kind is RoundKind.ESTIMATE:
            # a non-finite estimate half spoils its commit too: the whole step is skipped
            self.kept = KeptHalf(grad_sum, totals.round_count, totals.round_loss, totals.round_samples,
                                 skipped=totals.nonfinite, bad_ranks=tuple(totals.bad_ranks))
        else:
            self.kept = None

    def state_dict(self, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict]:
        if self.kept is None:
            return {}, {"kept": None}
        k = self.kept
        return {"kept_grad_sum": k.grad_sum.detach().cpu().contiguous()}, {"kept": {
            "count": k.count, "loss_sum": k.loss_sum, "samples": k.samples,
            "skipped": k.skipped, "bad_ranks": list(k.bad_ranks)}}

    def load_state_dict(self, ctx: RoundContext, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        k = meta.get("kept")
        self.kept = None if k is None else KeptHalf(
            self.kept_buf.copy_(tensors["kept_grad_sum"]), k["count"], k["loss_sum"], k["samples"],
            skipped=k.get("skipped", False), bad_ranks=tuple(k.get("bad_ranks", ())))
