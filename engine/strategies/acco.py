"""acco: two rounds per step (Nabli et al., ACCO, arXiv 2406.02613). The estimate round steps
from theta_t with the first half's gradient (state untouched) so compute goes on from the
estimate; the commit round steps from theta_t with both halves. Each half is sent once: the
owner keeps the reduced estimate half and adds it in the commit round (acco_loco/acco.py).

The ``acco`` section's delay corrections (acco_loco/delay.py; off by default): DC-ASGD's
compensation of the stale half, applied once at the estimate round to the kept sum (so the
estimate and the commit both use it), with the drift theta_t - thetatilde_t from the estimate
this owner sent; and weight prediction, the estimate round sending theta_t + s * (the last
committed update) in place of ACCO's half-batch step. ``sync_steps``: the first steps wait for each
round and their estimate round sends theta_t, so both halves are computed at theta_t (zero1's
update); the first overlapped step's stale half was computed at theta_t too, so nothing drifts.
``estimate_clip='step'``: under max_grad_norm the estimate round is clipped by the last commit's
norm (the whole batch's, one step older) instead of its own half-batch gradient's."""

from __future__ import annotations

import torch

from acco_loco import delay
from acco_loco.acco import KeptHalf, RoundKind, RoundPlan

from ..core.rounds import RoundContext, RoundRequest
from .base import Recut
from .sharded import RoundTotals, ShardedStrategy


class Acco(ShardedStrategy):
    plan = RoundPlan("acco", overlap=True, kinds=(RoundKind.ESTIMATE, RoundKind.COMMIT))
    sections = ("acco",)
    kept_shards = 1  # the reduced estimate half, until its commit round
    # the delay corrections' per-owner shards; the kept half belongs to the step in progress
    recut_rules = {**ShardedStrategy.recut_rules, "sent_estimate": Recut("shard"), "last_update": Recut("shard"),
                   "kept_grad_sum": Recut("step")}

    @classmethod
    def recut_refusal(cls, meta: dict) -> str | None:
        if meta.get("kept") is not None:
            return "it was taken between the rounds of a step: its kept half belongs to that step's workers"
        return None

    def __init__(self) -> None:
        self.kept: KeptHalf | None = None  # the reduced estimate half, until its commit round
        # its values: ACCO's own buffer, one shard long (with optimizer_offload='cpu' a host buffer of
        # the offload's, added back into the commit's device sum a piece at a time)
        self.kept_buf: torch.Tensor | None = None
        self.dc_lambda = 0.0
        self.predict_steps = 0.0
        self.sync_steps = 0
        self.clip_by_step = False
        self.commit_norm: float | None = None  # the last committed step's gradient norm (estimate_clip='step')
        self.state = None
        # delay compensation: the estimate this owner last sent (where the next stale half is computed)
        self.sent_estimate: torch.Tensor | None = None
        # weight prediction: theta_t - theta_{t-1} of this owner's shard
        self.last_update: torch.Tensor | None = None

    def setup(self, ctx: RoundContext) -> None:
        self.state = ctx.shard_state  # one object for the run (the context is frozen)
        super().setup(ctx)  # optimizer_offload='cpu': the state moves to host memory
        if self.offload is None:
            self.kept_buf = torch.empty_like(self.state.master)  # on the device: the reducer writes it
        else:  # only the step reads it: host memory, where the step's state is
            self.kept_buf = self.offload.host_buffer("acco.kept_half", self.state.master.numel())
        master = self.state.master  # the corrections' shards live where the master does
        self.dc_lambda = float(ctx.cfg.delay_compensation)
        self.predict_steps = float(ctx.cfg.weight_prediction)
        self.sync_steps = int(ctx.cfg.sync_steps)
        self.clip_by_step = ctx.cfg.estimate_clip == "step"
        if self.dc_lambda:
            self.sent_estimate = master.detach().clone()  # thetatilde_0 = theta_0
        if self.predict_steps:
            self.last_update = torch.zeros_like(master)

    def overlaps(self, step: int) -> bool:
        return step >= self.sync_steps

    def clip_norm(self, req: RoundRequest, grad_norm: float) -> float:
        if self.clip_by_step and req.kind is RoundKind.ESTIMATE and self.commit_norm is not None:
            return self.commit_norm  # the first step has none: its estimate is clipped by its own
        return grad_norm

    def reduce_into(self, req: RoundRequest) -> torch.Tensor | None:
        # offloaded: the reducer's own buffer, copied to the host once the round is done (``keep``)
        return self.kept_buf if req.kind is RoundKind.ESTIMATE and self.offload is None else None

    def step_sum(self, req: RoundRequest, grad_sum: torch.Tensor, kept: KeptHalf | None) -> torch.Tensor:
        if self.offload is not None and req.kind is RoundKind.COMMIT and kept is not None:
            return self.offload.add_from_host(grad_sum, kept.grad_sum)  # the same adds, a piece at a time
        return super().step_sum(req, grad_sum, kept)

    def carried(self, req: RoundRequest) -> KeptHalf | None:
        return self.kept if req.kind is RoundKind.COMMIT else None

    def correct(self, ctx: RoundContext, req: RoundRequest, step_sum: torch.Tensor, totals: RoundTotals) -> None:
        stale = not self.sync_steps or req.step_index > self.sync_steps
        if req.kind is RoundKind.ESTIMATE and self.dc_lambda and stale:
            # the stale half was computed on the estimate sent last step and is applied at theta_t;
            # clipping and the reported norm saw it before this term (the small all-reduce came first).
            # The synchronous steps' halves, and the first overlapped step's, were computed at theta_t
            drift = ctx.shard_state.master - self.sent_estimate
            delay.compensate_(step_sum, totals.round_count, drift.to(step_sum.device), self.dc_lambda)

    def after_piece(self, ctx: RoundContext, req: RoundRequest):
        if req.kind is RoundKind.ESTIMATE and req.step_index < self.sync_steps:
            return lambda proposal, a, b: proposal.part(a, b).master.copy_(ctx.shard_state.master[a:b])
        if req.kind is RoundKind.ESTIMATE and (self.predict_steps or self.dc_lambda):
            return lambda proposal, a, b: self._estimate_piece(ctx, proposal, a, b)
        if req.kind is RoundKind.COMMIT and self.predict_steps:
            return lambda proposal, a, b: torch.sub(proposal.part(a, b).master, ctx.shard_state.master[a:b],
                                                    out=self.last_update[a:b])
        return None

    def _estimate_piece(self, ctx: RoundContext, proposal, a: int, b: int) -> None:
        sent = proposal.part(a, b).master  # the spare's, or a piece-sized scratch's (step_copy)
        if self.predict_steps:
            delay.predict_(sent, ctx.shard_state.master[a:b], self.last_update[a:b], self.predict_steps)
        if self.dc_lambda:
            self.sent_estimate[a:b].copy_(sent)

    def keep(self, req: RoundRequest, grad_sum: torch.Tensor, totals: RoundTotals) -> None:
        stepped = not totals.nonfinite and totals.count > 0
        if req.kind is RoundKind.ESTIMATE:
            # a non-finite estimate half spoils its commit too: the whole step is skipped
            if self.offload is not None:
                grad_sum = self.offload.keep_on_host("acco.kept_half", grad_sum)
            self.kept = KeptHalf(grad_sum, totals.round_count, totals.round_loss, totals.round_samples,
                                 skipped=totals.nonfinite, bad_ranks=tuple(totals.bad_ranks))
            if self.sent_estimate is not None and not stepped:
                self.sent_estimate.copy_(self.state.master)  # the unchanged master went out
        else:
            self.kept = None
            if stepped:
                self.commit_norm = totals.grad_norm
            if self.last_update is not None and not stepped:
                self.last_update.zero_()  # nothing was installed: theta_{t+1} = theta_t

    def state_dict(self, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {name: t.detach().cpu().contiguous() for name, t in
                   (("sent_estimate", self.sent_estimate), ("last_update", self.last_update)) if t is not None}
        if self.kept is None:
            return tensors, {"kept": None, "commit_norm": self.commit_norm}
        k = self.kept
        tensors["kept_grad_sum"] = k.grad_sum.detach().cpu().contiguous()
        return tensors, {"commit_norm": self.commit_norm, "kept": {
            "count": k.count, "loss_sum": k.loss_sum, "samples": k.samples,
            "skipped": k.skipped, "bad_ranks": list(k.bad_ranks)}}

    def load_state_dict(self, ctx: RoundContext, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        for name in ("sent_estimate", "last_update"):
            mine = getattr(self, name)
            if mine is None:
                continue
            if name not in tensors:
                raise ValueError(f"the checkpoint has no ACCO {name} (saved with the acco section's "
                                 f"corrections off): resume with them off, or start a new run")
            mine.copy_(tensors[name])
        self.commit_norm = meta.get("commit_norm")  # absent in older checkpoints: the next commit sets it
        k = meta.get("kept")
        self.kept = None if k is None else KeptHalf(
            self.kept_buf.copy_(tensors["kept_grad_sum"]), k["count"], k["loss_sum"], k["samples"],
            skipped=k.get("skipped", False), bad_ranks=tuple(k.get("bad_ranks", ())))
