"""The two collectives of a round, apart from the loop: gradient reducers (a worker's gradient
sum -> the fp32 sum of its owned shard) and parameter gatherers (each owner's new shard -> the
full buffer every replica holds). Plain and compressed variants behind one interface each.

Low-bit values cannot be summed inside gloo/NCCL, so the compressed reduce-scatter is an
all_to_all of packed slices that each owner decodes and sums in fp32 (docs/DESIGN.md section 2).
Each row a worker sends to owner j holds: the packed payload of shard j, its scales, and the
sender's micro-batch count (the weight). Workers send their *mean* micro-batch gradient, so the
error state stays in one unit whatever the count of a round; the owner weights by the count.

The delta parameter all-gather sends Q(master_new - theta') where theta' is what every replica
holds; every replica, the owner included, adds the same decoded delta, so replicas stay
bit-identical and the owner's exact fp32 master carries any error into the next delta.
"""

from __future__ import annotations

import torch

from acco_loco.feedback import ErrorFeedback, compress
from acco_loco.registry import PARAM_DELTA_CODECS, WIRE_CODECS, GradCodecSpec, parse_grad_codec

from .comm import Comm
from .host import nonfinite_rows


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret received bytes as ``dtype``; a slice at an odd offset (sign1's payload is
    1/8 byte a value) is copied first, since a view needs the offset aligned to the dtype."""
    if not raw.is_contiguous() or raw.storage_offset() % dtype.itemsize:
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(dtype)


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------ gradient reducers
class PlainGrads:
    """Uncompressed reduce-scatter in the gradient's dtype, summed in fp32."""

    feedback = None

    def reduce(self, comm: Comm, full: torch.Tensor, count: int) -> torch.Tensor:
        return comm.reduce_scatter_sum(full)

    def begin_step(self) -> None:
        pass

    def end_step(self, committed_step: int, skipped: bool) -> None:
        pass

    def state_dict(self, mid_step: bool) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        pass


class CompressedGrads:
    """One worker's compensated, quantized reduce-scatter."""

    def __init__(self, spec: GradCodecSpec, numel: int, world: int, group_size: int, scale_dtype: str,
                 beta: float, reset_period: int, storage: str, device: torch.device, stochastic: bool, seed: int):
        self.codec = spec.make_wire(group_size, scale_dtype)
        self.world = world
        beta_arg = None if spec.feedback != "loco" else beta
        self.feedback = ErrorFeedback(spec.feedback, numel, beta=beta_arg, reset_period=reset_period,
                                      storage=storage, group_size=group_size, device=device)
        self.generator = None
        if stochastic:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def encode(self, full: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, scales) of this worker's compensated mean gradient; the error state moves on.

        Nothing here reads the gradient on the host: a non-finite gradient is encoded like any
        other (the codecs map it to non-finite or zero groups), the round's flags make every
        rank skip the step, and the skip rolls the error state back to the step's mark."""
        mean = full.to(torch.float32) / max(count, 1)
        if not self.feedback.active:  # nothing to compensate: no decoded copy needed
            return self.codec.encode(mean, self.generator, check_finite=False)
        payload, scales, _ = compress(mean, self.codec, self.feedback, self.generator, update=count > 0,
                                      check_finite=False)
        return payload, scales

    def reduce(self, comm: Comm, full: torch.Tensor, count: int) -> torch.Tensor:
        """fp32 sum over workers of count_w * deQ(mean_w) for this rank's shard."""
        n = self.world
        shard = full.numel() // n
        payload, scales = self.encode(full, count)
        p_len = payload.numel() // n
        s_len = scales.numel() * scales.element_size() // n
        weight = torch.tensor([float(count)], dtype=torch.float32, device=full.device).view(torch.uint8)
        rows = torch.cat([payload.view(n, p_len), _scale_bytes(scales).view(n, s_len),
                          weight.view(1, -1).expand(n, -1)], dim=1)
        received = comm.all_to_all_rows(rows)
        weights = _bytes_as(received[:, p_len + s_len:], torch.float32).view(n)  # stays on the device
        out = torch.zeros(shard, dtype=torch.float32, device=full.device)
        part = torch.empty(shard, dtype=torch.float32, device=full.device)
        for j, row in enumerate(received):
            row_scales = _bytes_as(row[p_len:p_len + s_len], scales.dtype)
            self.codec.decode(row[:p_len].contiguous(), row_scales, out=part)
            out.addcmul_(part, weights[j])
        return out

    def begin_step(self) -> None:
        self.feedback.mark()  # a skipped step goes back here: it must leave no error behind

    def end_step(self, committed_step: int, skipped: bool) -> None:
        if skipped:
            self.feedback.rollback()
        self.feedback.on_committed_step(committed_step)

    def state_dict(self, mid_step: bool) -> dict[str, torch.Tensor]:
        """The error state; between the rounds of a step also the step's mark (a skipped
        commit after a resume must still roll back to it)."""
        out = {f"feedback.{k}": v for k, v in self.feedback.state_dict().items()}
        if mid_step:
            out.update({f"feedback_mark.{k}": v for k, v in self.feedback.mark_state_dict().items()})
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        fb = {k[len("feedback."):]: v for k, v in tensors.items() if k.startswith("feedback.")}
        if not fb:
            raise ValueError(f"{where} holds no error-feedback state but the gradient codec needs it")
        self.feedback.load_state_dict(fb)
        mark = {k[len("feedback_mark."):]: v for k, v in tensors.items() if k.startswith("feedback_mark.")}
        if mark:
            self.feedback.load_mark_state_dict(mark)


# ------------------------------------------------------------------------ parameter gatherers
class CastParams:
    """All-gather of the new shards cast to a wire dtype (the compute dtype, or a cast)."""

    def __init__(self, wire_dtype: torch.dtype):
        self.wire_dtype = wire_dtype

    def gather(self, comm: Comm, new_shard: torch.Tensor, held: torch.Tensor) -> list[int]:
        """Fill ``held``; returns the ranks whose gathered values are not finite (``held`` must
        then be gathered again)."""
        if self.wire_dtype == held.dtype:
            wire = comm.all_gather(new_shard.to(held.dtype), held)
        else:
            wire = torch.empty(held.numel(), dtype=self.wire_dtype, device=held.device)
            comm.all_gather(new_shard.to(self.wire_dtype), wire)
        bad = nonfinite_rows(wire.view(comm.world_size, -1))
        if wire is not held and not bad:
            held.copy_(wire)
        return bad


class DeltaParams:
    """The delta all-gather of new parameter shards against what every replica holds."""

    def __init__(self, name: str, world: int, group_size: int, scale_dtype: str):
        self.codec = WIRE_CODECS[name](group_size, scale_dtype)
        self.world = world

    def gather(self, comm: Comm, new_shard: torch.Tensor, held: torch.Tensor) -> list[int]:
        """Update ``held`` (the full compute-param buffer every replica holds) in place.

        Returns the ranks whose new shard was not finite; ``held`` is then left untouched on
        every replica (each sees the same gathered rows, so all decide alike)."""
        n, rank = self.world, comm.rank
        shard = new_shard.numel()
        mine = held[rank * shard:(rank + 1) * shard].to(torch.float32)
        delta = new_shard.to(torch.float32) - mine
        payload, scales = self.codec.encode(delta, check_finite=False)
        # a NaN group would encode as scale 0: say it in the scales, on the device
        scales = torch.where(torch.isfinite(delta).all(), scales, float("nan")).to(scales.dtype)
        row = torch.cat([payload, _scale_bytes(scales)])
        rows = torch.empty((n, row.numel()), dtype=torch.uint8, device=row.device)
        comm.all_gather(row, rows.view(-1))
        p_len = payload.numel()
        row_scales = _bytes_as(rows[:, p_len:], scales.dtype)
        bad = nonfinite_rows(row_scales)
        if bad:
            return bad
        delta = torch.empty(shard, dtype=torch.float32, device=held.device)
        for j in range(n):
            self.codec.decode(rows[j, :p_len].contiguous(), row_scales[j], out=delta)
            view = held[j * shard:(j + 1) * shard]
            view.copy_(view.to(torch.float32).add_(delta))
        return []


def codec_groups(cfg) -> list[int]:
    """The group sizes the configured codecs need every shard to be a multiple of."""
    spec = parse_grad_codec(cfg.codec)
    groups = [] if spec is None else [spec.make_wire(cfg.group_size, cfg.scale_dtype).group_size]
    return groups + ([cfg.group_size] if cfg.param_codec in PARAM_DELTA_CODECS else [])


def make_collectives(cfg, padded: int, world: int, device: torch.device, rank: int, compute_dtype: torch.dtype):
    """(gradient reducer, parameter gatherer) for an EngineConfig."""
    spec = parse_grad_codec(cfg.codec)
    grads = PlainGrads() if spec is None else CompressedGrads(
        spec, padded, world, cfg.group_size, cfg.scale_dtype, cfg.loco_beta, cfg.reset_period,
        cfg.error_storage, device, cfg.stochastic_rounding, seed=cfg.seed * 65537 + rank)
    if cfg.param_codec in PARAM_DELTA_CODECS:
        return grads, DeltaParams(cfg.param_codec, world, cfg.group_size, cfg.scale_dtype)
    wire = compute_dtype if cfg.param_codec == "auto" else getattr(torch, cfg.param_codec)
    return grads, CastParams(wire)
