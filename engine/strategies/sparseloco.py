"""sparseloco: diloco's inner steps, with the outer momentum replaced by error feedback and the
pseudo-gradient sent as a chunked top-k of 2-bit values (Sarfi et al., "Communication Efficient
LLM Pre-training with SparseLoCo", arXiv 2508.15706). docs/local_steps.md.

One outer round, for worker w with theta_w after its inner steps and n_w samples in the period:

    Delta_w    = theta_sync - theta_w                              (fp32)
    e_w        = beta e_w + Delta_w                                (sparse_error_beta, 0.95)
    p_w        = C(e_w);   e_w = e_w - deQ(p_w)                    (acco_loco/topk_codec.py)
    all-gather the payloads p_w (each the same size)
    Delta      = sum_w a_w deQ(p_w)                                (sparse_aggregate='mean')
              or per value: sum_w a_w deQ(p_w) / sum_{w that sent it} a_w   ('contributors')
    theta_sync = theta_sync - outer_lr Delta
    theta_w    = theta_sync                                        (no overlap)

with a_w = n_w / sum_v n_v (1/R when all ran as many: the paper's sum / R). 'contributors' is
what the public templar code does (a per-coordinate mean over the peers that sent a value, via
scatter_reduce 'mean'). templar's other choices are options here (docs/sparseloco.md):
topk_layout='tensor' (tiles per tensor, 1-D tensors whole), sparse_clip='median' (each peer's
deQ(p_w) scaled per tensor to the median peer norm before combining) and
sparse_error_scale='outer_lr' (e_w = beta e_w + outer_lr Delta_w). Per worker and round, with
L = the codec's payload_bytes(P):

    bytes = (N - 1) L + 2 (N - 1) (2 + 4 N) 8 / N

The overlapped variant merges one round later, exactly as in diloco.py.

With the outer state on the CPU (outer_state_device='cpu') and the flat layout the round runs in
pieces of whole chunks (acco_loco/topk_pieces.py, the same bits): Delta_w is never whole (its
finiteness is checked a piece at a time, then each piece goes straight into the error and is
encoded), the payload is joined from the pieces' (a few percent of the values), and the combined
step is formed twice a piece at a time from the gathered payloads: once for the verdict on its
finiteness, once to install it. topk_layout='tensor' keeps the whole round (its tiles run across
the flat pieces).
"""

from __future__ import annotations

import math

import torch

from acco_loco.outer import accumulate_error, pseudo_gradient, sparse_outer_step
from acco_loco.registry import PSEUDO_GRAD_CODECS
from acco_loco.tiled_topk import TiledTopK, tensor_segments
from acco_loco.topk_codec import TopKCodec, aggregate
from acco_loco.topk_pieces import PieceAggregate, PieceEncoder, chunk_pieces

from ..core.rounds import RoundContext
from ..runtime.host import host_flag, nonfinite_flag
from .local_steps import LocalStepStrategy
from .outer_state import PIECE
from .spec import ALIGN, padded, small_bytes


def make_codec(cfg, shapes=None, numel: int | None = None) -> TopKCodec | TiledTopK:
    """The pseudo-gradient codec; topk_layout='tensor' needs the tensors' ``shapes`` and the buffer's ``numel``."""
    if cfg.topk_layout == "tensor":
        if shapes is None:
            raise ValueError("topk_layout='tensor' tiles each tensor: give the parameter shapes")
        return TiledTopK(shapes, numel, math.isqrt(cfg.topk_chunk), cfg.topk_density, cfg.topk_value_bits)
    return PSEUDO_GRAD_CODECS["topk"](cfg.topk_chunk, cfg.topk_density, cfg.topk_value_bits)


def spec_round_parts(numel: int, world: int, mode, ws) -> dict:
    """round_bytes below, by collective, for the planner (ws.topk_* the codec's settings)."""
    payload = PSEUDO_GRAD_CODECS["topk"](ws.topk_chunk, ws.topk_density, ws.topk_bits).payload_bytes(
        padded(numel, world, ALIGN))
    return {"all_to_all": 0, "all_gather": (world - 1) * payload, "small": small_bytes(world, 2 + 4 * world)}


class SparseLoCo(LocalStepStrategy):
    name = "sparseloco"
    sections = ("outer", "sparseloco")  # shared local-step settings, and its own (sparseloco_config.py)
    outer_cost, outer_round_parts = "outer_topk_s_per_param", staticmethod(spec_round_parts)

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        side = math.isqrt(cfg.topk_chunk)
        if cfg.topk_layout == "tensor" and side * side != cfg.topk_chunk:
            raise ValueError(f"topk_layout='tensor' cuts square tiles of topk_chunk values: topk_chunk={cfg.topk_chunk} "
                             f"is not a square (4096 = 64 x 64, 1024, 256, ...)")

    def setup_outer(self, ctx: RoundContext) -> None:
        cfg, numel = ctx.cfg, self.theta_sync.numel()
        self.error = torch.zeros_like(self.theta_sync)
        shapes = [tuple(p.shape) for p in ctx.flat.params]
        per_tensor = [name for name, on in (("topk_layout='tensor'", cfg.topk_layout == "tensor"),
                                            ("sparse_clip='median'", cfg.sparse_clip == "median")) if on]
        if per_tensor and self.sharded:  # FSDP2's local shards are rows of each tensor, not whole tensors
            raise ValueError(f"{' and '.join(per_tensor)} work on whole tensors, and with model_sharding='node' each "
                             "rank holds its local rows of every tensor: set topk_layout='flat' and "
                             "sparse_clip='none', or model_sharding='none'")
        if per_tensor and numel != ctx.flat.padded:  # a node replica's slice cuts across tensors
            raise ValueError(f"{' and '.join(per_tensor)} work on whole tensors, and with node replicas each rank "
                             "holds a slice of the buffer: set topology='flat'")
        self.codec = make_codec(cfg, shapes, numel)
        if isinstance(self.codec, TiledTopK):
            self.codec.to(self.theta_sync.device)
        self.clip = tensor_segments(shapes, numel, self.theta_sync.device) if cfg.sparse_clip == "median" else None
        self.error_scale = cfg.outer_lr if cfg.sparse_error_scale == "outer_lr" else 1.0
        # on the host, the round in pieces of whole chunks (the tiled layout's chunks are not runs of the buffer)
        self.pieces = (chunk_pieces(numel, self.codec.chunk, self.outer_piece)
                       if cfg.outer_state_device == "cpu" and isinstance(self.codec, TopKCodec) else None)

    outer_piece = PIECE  # values of the round's pieces with the outer state on the CPU (the tests set fewer)

    def form_pseudo_gradient(self) -> torch.Tensor | None:
        """None when the round runs in pieces: Delta_w is formed a piece at a time in outer_update."""
        return None if self.pieces is not None else super().form_pseudo_gradient()

    def pseudo_gradient_flag(self, delta: torch.Tensor | None) -> torch.Tensor:
        if delta is not None:
            return super().pseudo_gradient_flag(delta)
        flag = torch.zeros((), dtype=torch.float64, device=self.theta_sync.device)
        for a, b in self.pieces:
            flag = torch.maximum(flag, nonfinite_flag(pseudo_gradient(self.theta_sync[a:b], self.submitted[a:b])))
        return flag

    def outer_update(self, ctx: RoundContext, delta: torch.Tensor | None, shares: list[float]) -> bool:
        if delta is None:
            return self._outer_update_in_pieces(ctx, shares)
        cfg, comm, numel = ctx.cfg, ctx.comm, delta.numel()
        accumulate_error(self.error, delta, cfg.sparse_error_beta, self.error_scale)
        # the error is finite: the round agreed every Delta_w was, and a non-finite theta_sync is refused
        payload, sent = self.codec.encode_with_decoded(self.error, check_finite=False)
        self.error.sub_(sent)  # what was not sent stays for later rounds
        payload = self.place.to_wire(payload)  # the collectives take the compute device's tensors (outer_state.py)
        gathered = torch.empty(comm.world_size * payload.numel(), dtype=torch.uint8, device=payload.device)
        comm.all_gather(payload, gathered)
        gathered = self.place.from_wire(gathered)
        combined = aggregate(self.codec, gathered.view(comm.world_size, -1), shares, numel, cfg.sparse_aggregate,
                             self.clip)
        new = sparse_outer_step(self.theta_sync, combined, cfg.outer_lr)
        if not host_flag(torch.isfinite(new).all()):  # the same verdict on every replica
            return False
        self.theta_sync.copy_(new)
        return True

    def _outer_update_in_pieces(self, ctx: RoundContext, shares: list[float]) -> bool:
        """outer_update's values, a piece at a time: the error and the encoding (Delta_w formed per
        piece), the all-gather of the joined payload, then the combined step twice (finite? install)."""
        cfg, comm, numel = ctx.cfg, ctx.comm, self.theta_sync.numel()
        encoder = PieceEncoder(self.codec)
        for a, b in self.pieces:
            self._encode_piece(encoder, a, b, cfg.sparse_error_beta)
        payload = self.place.to_wire(encoder.payload())
        gathered = torch.empty(comm.world_size * payload.numel(), dtype=torch.uint8, device=payload.device)
        comm.all_gather(payload, gathered)
        del payload  # from here on the gathered rows only (every rank's payload)
        gathered = self.place.from_wire(gathered)
        combined = PieceAggregate(self.codec, gathered.view(comm.world_size, -1), shares, numel,
                                  cfg.sparse_aggregate, self.clip, self.outer_piece)
        finite = torch.ones((), dtype=torch.bool, device=self.theta_sync.device)
        for a, b in self.pieces:
            finite &= self._step_piece(combined, a, b, cfg.outer_lr, install=False)
        if not host_flag(finite):  # the same verdict on every replica
            return False
        for a, b in self.pieces:
            self._step_piece(combined, a, b, cfg.outer_lr, install=True)
        return True

    def _encode_piece(self, encoder: PieceEncoder, a: int, b: int, beta: float) -> None:
        """e_w[a:b] = beta e_w + Delta_w[a:b], encoded, less what was sent (a call of its own: the
        piece's temporaries are freed before the next piece's are made)."""
        error = self.error[a:b]
        accumulate_error(error, pseudo_gradient(self.theta_sync[a:b], self.submitted[a:b]), beta, self.error_scale)
        error.sub_(encoder.add(error))  # what was not sent stays for later rounds

    def _step_piece(self, combined: PieceAggregate, a: int, b: int, lr: float, install: bool) -> torch.Tensor:
        """theta_sync[a:b] - lr Delta[a:b]: whether it is finite, or (install) written into theta_sync."""
        new = sparse_outer_step(self.theta_sync[a:b], combined.piece(a, b), lr)
        if install:
            return self.theta_sync[a:b].copy_(new)
        return torch.isfinite(new).all()

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        return {"outer.error": self.error}

    def load_outer(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.error.copy_(tensors["outer.error"])


def round_bytes(cfg, padded: int, world: int, shapes=None) -> int:
    """What one worker sends in one sparseloco round (Comm's count): its payload to each of the
    N - 1 others, and the small all-reduce of 2 + 4N float64 values (``shapes``: topk_layout='tensor')."""
    return ((world - 1) * make_codec(cfg, shapes, padded).payload_bytes(padded)
            + 2 * (world - 1) * (2 + 4 * world) * 8 // world)
