"""diloco: every worker takes H inner optimizer steps alone, then the workers average their
pseudo-gradients and move the synchronised parameters with outer Nesterov SGD (Douillard et al.,
"DiLoCo: Distributed Low-Communication Training of Language Models", arXiv 2311.08105; their
outer lr 0.7 and momentum 0.9 are the defaults). docs/local_steps.md.

One outer round, for worker w with theta_w after its inner steps and n_w samples in the period:

    Delta_w    = theta_sync - theta_w                              (fp32)
    Delta      = sum_w (n_w / sum_v n_v) Delta_w                   (1/R each when all ran as many)
    buf        = Delta on the first round, else mu buf + Delta
    theta_sync = theta_sync - outer_lr (Delta + mu buf)            (heavy_ball: - outer_lr buf)
    theta_w    = theta_sync                                        (no overlap)

The average is a reduce-scatter (``Comm.all_to_all_rows`` of the pseudo-gradient in
``pseudo_grad_dtype``; each owner sums its shard in fp32, in rank order, weighted by the sample
shares) and an all-gather of the averaged shards in the same dtype: the bytes of a ring
all-reduce, and every replica gets the same bits. Per worker and round:

    bytes = 2 (N - 1) (P / N) e + 2 (N - 1) (2 + 4 N) 8 / N        (e = 4 for float32, 2 for bfloat16)

With ``outer_overlap`` the workers keep stepping while the round travels and merge its result one
round later (engine/strategies/local_steps.py, docs/local_steps.md):

    at the boundary that ends period t:   theta_w += theta_sync_t - s_w     (if round t-1 was sent)
                                          s_w = theta_w;  Delta_w = theta_sync_t - s_w;  send round t
    round t computes theta_sync_{t+1} from Delta_t while period t+1 runs on theta_w.
"""

from __future__ import annotations

import torch

from acco_loco.optim import ShardState
from acco_loco.outer import outer_sgd_spec, outer_sgd_step

from ..core.rounds import RoundContext
from ..runtime.host import host_flag
from .local_steps import LocalStepStrategy
from .outer_state import PIECE
from .spec import ALIGN, padded, small_bytes

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def spec_round_parts(numel: int, world: int, mode, ws) -> dict:
    """round_bytes below, by collective, for the planner (ws.pseudo_grad_bytes on the wire)."""
    half = (world - 1) * (padded(numel, world, ALIGN) // world) * ws.pseudo_grad_bytes
    return {"all_to_all": half, "all_gather": half, "small": small_bytes(world, 2 + 4 * world)}


class DiLoCo(LocalStepStrategy):
    name = "diloco"
    sections = ("outer", "diloco")  # shared local-step settings, and its own (diloco_config.py)
    outer_cost, outer_round_parts = "outer_sgd_s_per_param", staticmethod(spec_round_parts)

    def setup_outer(self, ctx: RoundContext) -> None:
        cfg = ctx.cfg
        self.momentum = torch.zeros_like(self.theta_sync)
        self.outer_steps = 0  # the momentum buffer starts as the first Delta (torch.optim.SGD)
        self.spec = outer_sgd_spec(cfg.outer_momentum, cfg.outer_momentum_kind == "nesterov")
        self.wire = WIRE_DTYPES[cfg.pseudo_grad_dtype]

    def form_pseudo_gradient(self) -> torch.Tensor:
        """With the outer state on the CPU and no overlap, Delta_w is written over the snapshot s_w
        (the same subtraction, the same bits): nothing reads s_w after its round (it is saved, and
        merged, only with overlap), so the round makes no full-size pseudo-gradient (4 B a value)."""
        if self.cfg.outer_state_device != "cpu" or self.plan.overlap:
            return super().form_pseudo_gradient()
        return torch.sub(self.theta_sync, self.submitted, out=self.submitted)

    def outer_update(self, ctx: RoundContext, delta: torch.Tensor, shares: list[float]) -> bool:
        """The outer step piece by piece, twice: first whether every new value is finite (the same
        verdict on every replica), then written in place (theta_sync and the momentum are
        persistent buffers the compute side reads): no full-size proposal (8 bytes per value).
        With the outer state on the CPU the average is written over ``delta``."""
        mean = self.average(ctx, delta, shares)
        lr, n, step = ctx.cfg.outer_lr, mean.numel(), self.outer_piece
        finite = torch.ones((), dtype=torch.bool, device=mean.device)
        for a in range(0, n, step):
            finite &= torch.isfinite(self._piece(mean, a, a + step, lr).master).all()
        if not host_flag(finite):
            return False
        for a in range(0, n, step):
            self._install_piece(mean, a, a + step, lr)
        self.outer_steps += 1
        return True

    def _install_piece(self, mean: torch.Tensor, a: int, b: int, lr: float) -> None:
        """Values [a, b) of the outer step written into theta_sync and the momentum (a call of its
        own: the piece's proposal is freed before the next piece's is made)."""
        piece = self._piece(mean, a, b, lr)
        self.theta_sync[a:b].copy_(piece.master)
        self.momentum[a:b].copy_(piece.exp_avg)

    def _piece(self, mean: torch.Tensor, a: int, b: int, lr: float) -> ShardState:
        """Values [a, b) of the outer step's proposal (momentum SGD is elementwise: the same bits)."""
        state = ShardState(master=self.theta_sync[a:b], exp_avg=self.momentum[a:b], step=self.outer_steps)
        return outer_sgd_step(state, mean[a:b], lr, self.spec)

    outer_piece = PIECE  # values of the outer step's proposal at a time (the tests set fewer)
    wire_piece = PIECE  # values of every rank's columns together per exchange, with the outer state on the CPU

    def average(self, ctx: RoundContext, delta: torch.Tensor, shares: list[float]) -> torch.Tensor:
        """sum_w shares[w] Delta_w, in fp32, via reduce-scatter + all-gather in the wire dtype. With
        the outer state on the CPU the exchange runs over column pieces of the [world, L] rows, so
        the device holds a piece of the wire rows, not the whole (each value's sum is the same), and
        each piece's average is written over the columns of ``delta`` it was sent from."""
        comm, n, place = ctx.comm, ctx.comm.world_size, self.place
        if self.cfg.outer_state_device == "cpu":
            return self._average_in_pieces(comm, delta, shares)
        # row r: rank r's piece of my shard (the wire tensors on the compute device: outer_state.py)
        rows = comm.all_to_all_rows(place.to_wire(delta.to(self.wire)).view(n, -1))
        mine = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
        for rank, share in enumerate(shares):
            if share:
                mine.add_(rows[rank].to(torch.float32), alpha=share)
        out = torch.empty(delta.numel(), dtype=self.wire, device=rows.device)
        comm.all_gather(mine.to(self.wire), out)
        return place.from_wire(out).to(torch.float32)

    def _average_in_pieces(self, comm, delta: torch.Tensor, shares: list[float]) -> torch.Tensor:
        """The average over ``delta`` itself: a piece's columns are sent (all_to_all_rows returns
        once its send has been read) before they are overwritten, and no later piece reads them."""
        n = comm.world_size
        cols = delta.numel() // n
        step = max(1, self.wire_piece // n)
        for c0 in range(0, cols, step):
            self._average_piece(comm, delta.view(n, cols)[:, c0:min(cols, c0 + step)], shares)
        return delta

    def _average_piece(self, comm, columns: torch.Tensor, shares: list[float]) -> None:
        """``columns`` ([world, c], a view of the pseudo-gradient) replaced by their average (a call
        of its own: the piece's wire rows are freed before the next piece's are made). The gathered
        averages go into the received rows, which the sum has finished reading."""
        n, c, place = comm.world_size, columns.shape[1], self.place
        rows = comm.all_to_all_rows(place.to_wire(columns.to(self.wire)))
        mine = torch.zeros(c, dtype=torch.float32, device=rows.device)
        for rank, share in enumerate(shares):
            if share:
                mine.add_(rows[rank].to(torch.float32), alpha=share)
        got = rows.view(-1) if rows.is_contiguous() else torch.empty(n * c, dtype=self.wire, device=rows.device)
        comm.all_gather(mine.to(self.wire), got)
        columns.copy_(place.from_wire(got.view(n, c)).to(torch.float32))

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        return {"outer.momentum": self.momentum}

    def outer_meta(self) -> dict:
        return {"outer_steps": self.outer_steps}

    def load_outer(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.momentum.copy_(tensors["outer.momentum"])
        self.outer_steps = meta["outer_steps"]


def round_bytes(padded: int, world: int, dtype: str = "float32") -> int:
    """What one worker sends in one diloco round (Comm's count): reduce-scatter + all-gather of the
    pseudo-gradient in ``dtype``, and the small all-reduce of 2 + 4N float64 values."""
    e = torch.tensor([], dtype=WIRE_DTYPES[dtype]).element_size()
    return 2 * (world - 1) * (padded // world) * e + 2 * (world - 1) * (2 + 4 * world) * 8 // world
