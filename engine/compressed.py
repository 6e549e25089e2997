"""Low-bit collectives: the compressed reduce-scatter and the delta parameter all-gather.

Low-bit values cannot be summed inside gloo/NCCL, so the reduce-scatter is an all_to_all of
packed slices that each owner dequantizes and sums in fp32 (docs/DESIGN.md section 2). Each row a
worker sends to owner j holds: the packed payload of shard j, its group scales, and the
sender's micro-batch count (the weight). Workers send their *mean* micro-batch gradient, so the
error state stays in one unit whatever the count of a round; the owner weights by the count.

The parameter all-gather sends Q(master_new - theta') where theta' is what every replica holds;
every replica, the owner included, adds the same decoded delta, so replicas stay bit-identical
and the owner's exact fp32 master carries any error into the next delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from acco_loco.codecs import Codec, make_codec
from acco_loco.feedback import ErrorFeedback

from .comm import Comm
from .flat import nonfinite_rows

GRAD_FEEDBACK = {"int": "none", "sign": "none", "ef": "ef", "loco": "loco"}
PARAM_CODECS = ("auto", "float32", "bfloat16", "int8", "int4")


@dataclass(frozen=True)
class GradCodecSpec:
    feedback: str  # none | ef | loco
    bits: int


def parse_grad_codec(name: str) -> GradCodecSpec | None:
    """'none' -> None; 'loco4' -> LoCo 4-bit; 'ef8', 'int4', 'sign1', 'loco1', ... ."""
    if name == "none":
        return None
    for prefix, feedback in GRAD_FEEDBACK.items():
        if name.startswith(prefix) and name[len(prefix):] in ("8", "4", "2", "1"):
            bits = int(name[len(prefix):])
            if prefix == "int" and bits == 1 or prefix == "sign" and bits != 1:
                break
            return GradCodecSpec(feedback, bits)
    raise ValueError(f"unknown codec {name!r}: 'none', or <kind><bits> with kind int (plain), ef "
                     "(classic error feedback) or loco (LoCo moving average) and bits 8, 4 or 2, "
                     "or 1-bit 'sign1' / 'ef1' / 'loco1' (sign x RMS)")


def codec_for_bits(bits: int, group_size: int, scale_dtype: str) -> Codec:
    name = {8: "int8", 4: "int4", 2: "int2", 1: "sign1"}[bits]
    return make_codec(name, group_size=group_size, scale_dtype=scale_dtype)


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret received bytes as ``dtype``; a slice at an odd offset (sign1's payload is
    1/8 byte a value) is copied first, since a view needs the offset aligned to the dtype."""
    if not raw.is_contiguous() or raw.storage_offset() % dtype.itemsize:
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(dtype)


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.contiguous().view(torch.uint8)


class CompressedGrads:
    """One worker's compensated, quantized reduce-scatter."""

    def __init__(self, spec: GradCodecSpec, numel: int, world: int, group_size: int, scale_dtype: str,
                 beta: float, reset_period: int, storage: str, device: torch.device, stochastic: bool, seed: int):
        self.codec = codec_for_bits(spec.bits, group_size, scale_dtype)
        self.world = world
        beta_arg = None if spec.feedback != "loco" else beta
        self.feedback = ErrorFeedback(spec.feedback, numel, beta=beta_arg, reset_period=reset_period,
                                      storage=storage, group_size=group_size, device=device)
        self.generator = None
        if stochastic:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def reduce_scatter(self, comm: Comm, full: torch.Tensor, count: int, finite: bool = True) -> torch.Tensor:
        """fp32 sum over workers of count_w * deQ(mean_w) for this rank's shard.

        A non-finite gradient is not encoded: the worker sends zeros with weight 0 and the
        round's flags make every rank skip the step."""
        n = self.world
        shard = full.numel() // n
        if not finite:
            count = 0
        mean = full.to(torch.float32) / max(count, 1) if finite else torch.zeros(full.numel(), device=full.device)
        h = self.feedback.compensate(mean)
        if self.feedback.active:
            payload, scales, sent = self.codec.encode_with_decoded(h, self.generator)
            if count > 0:  # a worker with nothing to send keeps its error for the next round
                self.feedback.update(h, sent)
        else:
            payload, scales = self.codec.encode(h, self.generator)
        weight = torch.tensor([float(count)], dtype=torch.float32, device=full.device).view(torch.uint8)
        rows = torch.cat([payload.view(n, -1), _scale_bytes(scales).view(n, -1),
                          weight.view(1, -1).expand(n, -1)], dim=1)
        received = comm.all_to_all_rows(rows)
        p_len = payload.numel() // n
        s_len = scales.numel() * scales.element_size() // n
        out = torch.zeros(shard, dtype=torch.float32, device=full.device)
        part = torch.empty(shard, dtype=torch.float32, device=full.device)
        for row in received:
            w = float(_bytes_as(row[p_len + s_len:], torch.float32))
            if w == 0.0:
                continue
            row_scales = _bytes_as(row[p_len:p_len + s_len], scales.dtype)
            self.codec.decode(row[:p_len].contiguous(), row_scales, out=part)
            out.add_(part, alpha=w)
        return out


class CompressedParams:
    """The delta all-gather of new parameter shards against what every replica holds."""

    def __init__(self, name: str, world: int, group_size: int, scale_dtype: str):
        self.codec = make_codec(name, group_size=group_size, scale_dtype=scale_dtype)
        self.world = world

    def all_gather(self, comm: Comm, new_shard: torch.Tensor, held: torch.Tensor, rank: int) -> list[int]:
        """Update ``held`` (the full compute-param buffer every replica holds) in place.

        Returns the ranks whose new shard was not finite; ``held`` is then left untouched on
        every replica (each sees the same gathered rows, so all decide alike)."""
        n = self.world
        shard = new_shard.numel()
        mine = held[rank * shard:(rank + 1) * shard].to(torch.float32)
        delta = new_shard.to(torch.float32) - mine
        payload, scales = self.codec.encode(delta, check_finite=False)
        if nonfinite_rows(delta.view(1, -1)):
            scales.fill_(float("nan"))  # a NaN group would encode as scale 0: say it in the scales
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


def build_codecs(cfg, padded: int, world: int, device: torch.device, rank: int):
    """(CompressedGrads | None, CompressedParams | None) for an EngineConfig."""
    spec = parse_grad_codec(cfg.codec)
    grads = None
    if spec is not None:
        grads = CompressedGrads(spec, padded, world, cfg.group_size, cfg.scale_dtype, cfg.loco_beta,
                                cfg.reset_period, cfg.error_storage, device, cfg.stochastic_rounding,
                                seed=cfg.seed * 65537 + rank)
    params = None
    if cfg.param_codec in ("int8", "int4"):
        params = CompressedParams(cfg.param_codec, world, cfg.group_size, cfg.scale_dtype)
    return grads, params
