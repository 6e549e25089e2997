"""Chunked top-k with low-bit values: the pseudo-gradient codec of SparseLoCo (Sarfi et al.,
"Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706), pure tensor math.

A flat fp32 tensor of ``numel`` values is cut into ``M = ceil(numel / C)`` chunks of ``C`` values
(the last one padded with zeros). Per chunk the codec keeps the ``k`` values of largest magnitude
and sends each as its index within the chunk and a ``B``-bit code:

* **selection**: the ``k = ceil(density * C)`` largest ``|x|`` of the chunk; equal magnitudes are
  taken lower index first, so the selection is a function of the values alone (the key
  ``bits(|x|) * C + (C - 1 - j)`` is unique per value, and fp32 bit patterns of non-negative
  numbers order like the numbers);
* **values**: sign and magnitude. The top bit of a code is the sign (1 = negative); the other
  ``B - 1`` bits pick one of ``L = 2^(B-1)`` magnitude levels on a uniform grid between the
  chunk's smallest and largest kept magnitude, ``lo`` and ``hi``::

      step = (hi - lo) / L
      q    = clamp(floor((|x| - lo) / step), 0, L - 1)          (q = 0 when step = 0)
      deQ  = sign(x) * (lo + (q + 1/2) step)                     |x - deQ| <= step / 2 = (hi - lo) / 2^B

  (1 bit: every kept value becomes ``sign * (lo + hi) / 2``). Kept values are the large ones, so
  a grid over ``[lo, hi]`` spends no code on small magnitudes that were never sent;
* **indices**: ``w = ceil(log2 C)`` bits each (12 for C = 4096).

Wire format of one payload (a 1-D uint8 tensor whose size depends only on ``numel``)::

    | indices: ceil(M k w / 8) bytes | value codes: ceil(M k B / 8) bytes | lo, hi: 8 M bytes |

Indices are one little-endian bit stream (bit t of the i-th kept index, chunks in order and each
chunk's indices ascending, at stream position ``i w + t``; stream bit p is bit ``p mod 8`` of byte
``p // 8``). Value codes are packed by ``acco_loco/bitpack.py`` (``8 / B`` codes per byte, in the
same order as the indices). ``lo`` and ``hi`` are fp32, chunk by chunk, little-endian. So

    payload_bytes(numel) = ceil(M k w / 8) + ceil(M k B / 8) + 8 M.

Decoding scatters the decoded values back into a dense tensor (positions past ``numel`` are
padding and dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .bitpack import pack_bits, pad_to_multiple, unpack_bits

VALUE_BITS = (1, 2, 4, 8)  # what bitpack packs
MAX_CHUNK = 2**16  # indices fit 16 bits
CLIP_EPS = 1e-8  # the median clip's (templar's): keeps an all-zero contribution finite


@dataclass(frozen=True)
class TopKCodec:
    """One top-k configuration: ``chunk`` values per chunk, ``density`` of them kept, ``bits``
    per kept value. See the module docstring for the math and the wire format."""

    chunk: int = 4096
    density: float = 0.02
    bits: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 2 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"chunk must be an integer in [2, {MAX_CHUNK}], got {self.chunk!r}")
        if (isinstance(self.density, bool) or not isinstance(self.density, (int, float))
                or not math.isfinite(self.density) or not 0 < self.density <= 1):
            raise ValueError(f"density must be a finite number in (0, 1], got {self.density!r}")
        if self.bits not in VALUE_BITS or isinstance(self.bits, bool):
            raise ValueError(f"bits must be one of {VALUE_BITS}, got {self.bits!r}")

    # ------------------------------------------------------------------ sizes
    @property
    def k(self) -> int:
        """Values kept per chunk: ceil(density * chunk), at least 1 (the tiny slack keeps a
        product such as 0.1 * 30 = 3.0000000000000004 at 3)."""
        return min(self.chunk, max(1, math.ceil(self.density * self.chunk - 1e-9)))

    @property
    def index_bits(self) -> int:
        """ceil(log2 chunk): 12 for 4096."""
        return (self.chunk - 1).bit_length()

    def chunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def index_bytes(self, numel: int) -> int:
        return -(-self.chunks(numel) * self.k * self.index_bits // 8)

    def value_bytes(self, numel: int) -> int:
        return -(-self.chunks(numel) * self.k * self.bits // 8)

    def scale_bytes(self, numel: int) -> int:
        return 8 * self.chunks(numel)  # lo and hi, fp32

    def payload_bytes(self, numel: int) -> int:
        """Bytes of one payload for ``numel`` values (the formula of the module docstring)."""
        return self.index_bytes(numel) + self.value_bytes(numel) + self.scale_bytes(numel)

    # ------------------------------------------------------------------ encode
    def select(self, x: Tensor, check_finite: bool = True) -> tuple[Tensor, Tensor]:
        """(indices [M, k] int64 ascending within each chunk, values [M, k] fp32) of the kept values.
        ``check_finite=False``: the caller knows ``x`` is finite (the check reads the device on the
        host: a wait on a GPU)."""
        if x.dim() != 1:
            raise ValueError(f"top-k encodes a 1-D tensor, got shape {tuple(x.shape)}")
        if check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError("the tensor to encode holds NaN/Inf values: refusing to encode them")
        c = self.chunk
        chunks = pad_to_multiple(x.to(torch.float32), c).view(-1, c)
        magnitude_bits = chunks.abs().view(torch.int32).to(torch.int64)  # orders like |x|
        tie_break = (c - 1) - torch.arange(c, device=x.device, dtype=torch.int64)  # lower index wins
        keys = magnitude_bits * c + tie_break
        top = torch.topk(keys, self.k, dim=1, sorted=False).indices
        idx = torch.sort(top, dim=1).values
        return idx, torch.gather(chunks, 1, idx)

    def quantize(self, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(codes [M, k] uint8, lo [M], hi [M]) of the kept values (sign bit on top)."""
        mag = values.abs()
        lo, hi = mag.min(dim=1).values, mag.max(dim=1).values
        levels = 1 << (self.bits - 1)
        step = ((hi - lo) / levels)[:, None]
        safe = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.floor((mag - lo[:, None]) / safe).clamp_(0, levels - 1)
        q = torch.where(step > 0, q, torch.zeros_like(q)).to(torch.uint8)
        sign = (values < 0).to(torch.uint8) << (self.bits - 1)
        return sign | q, lo, hi

    def dequantize(self, codes: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
        """fp32 values [M, k] of codes [M, k] with their chunks' lo and hi."""
        levels = 1 << (self.bits - 1)
        q = (codes & (levels - 1)).to(torch.float32)
        step = ((hi - lo) / levels)[:, None]
        mag = lo[:, None] + (q + 0.5) * step
        negative = (codes >> (self.bits - 1)).bool()
        return torch.where(negative, -mag, mag)

    def encode(self, x: Tensor, check_finite: bool = True) -> Tensor:
        """The payload of ``x`` (fp32, 1-D)."""
        return self.encode_with_decoded(x, check_finite)[0]

    def encode_with_decoded(self, x: Tensor, check_finite: bool = True) -> tuple[Tensor, Tensor]:
        """(payload, what a receiver decodes from it as a dense fp32 tensor like ``x``)."""
        idx, values = self.select(x, check_finite)
        codes, lo, hi = self.quantize(values)
        dense = self._scatter(x.numel(), idx, self.dequantize(codes, lo, hi), x.device)
        return self._pack(idx, codes, lo, hi), dense

    # ------------------------------------------------------------------ decode
    def decode_sparse(self, payload: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        """(flat positions int64, fp32 values) a payload for ``numel`` values carries; positions
        are unique and below ``numel``."""
        idx, codes, lo, hi = self._unpack(payload, numel)
        values = self.dequantize(codes, lo, hi)
        pos = idx + torch.arange(idx.shape[0], device=idx.device, dtype=torch.int64)[:, None] * self.chunk
        pos, values = pos.reshape(-1), values.reshape(-1)
        inside = pos < numel
        return pos[inside], values[inside]

    def decode(self, payload: Tensor, numel: int) -> Tensor:
        """The dense fp32 tensor of ``numel`` values a payload stands for (zeros where nothing was sent)."""
        pos, values = self.decode_sparse(payload, numel)
        out = torch.zeros(numel, dtype=torch.float32, device=payload.device)
        return out.index_put_((pos,), values)

    # ------------------------------------------------------------------ wire format
    def _scatter(self, numel: int, idx: Tensor, values: Tensor, device) -> Tensor:
        out = torch.zeros(self.chunks(numel) * self.chunk, dtype=torch.float32, device=device)
        out.view(-1, self.chunk).scatter_(1, idx, values)
        return out[:numel]

    def _pack(self, idx: Tensor, codes: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
        w = self.index_bits
        shifts = torch.arange(w, device=idx.device, dtype=torch.int64)
        index_bits = ((idx.reshape(-1, 1) >> shifts) & 1).to(torch.uint8).reshape(-1)
        index_bytes = pack_bits(pad_to_multiple(index_bits, 8), 1)
        value_bytes = pack_bits(pad_to_multiple(codes.reshape(-1), 8 // self.bits), self.bits)
        scales = torch.stack([lo, hi], dim=1).to(torch.float32).contiguous().view(torch.uint8).reshape(-1)
        return torch.cat([index_bytes, value_bytes, scales])

    def _unpack(self, payload: Tensor, numel: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != self.payload_bytes(numel):
            raise ValueError(f"a top-k payload for {numel} values is a 1-D uint8 tensor of "
                             f"{self.payload_bytes(numel)} bytes, got {payload.dtype} {tuple(payload.shape)}")
        m, k, w = self.chunks(numel), self.k, self.index_bits
        a, b = self.index_bytes(numel), self.index_bytes(numel) + self.value_bytes(numel)
        bits = unpack_bits(payload[:a], 1, m * k * w).view(m * k, w).to(torch.int64)
        idx = (bits << torch.arange(w, device=payload.device, dtype=torch.int64)).sum(dim=1).view(m, k)
        codes = unpack_bits(payload[a:b], self.bits, m * k).view(m, k)
        scales = payload[b:].clone().view(torch.float32).view(m, 2)
        return idx, codes, scales[:, 0].contiguous(), scales[:, 1].contiguous()


def aggregate(codec: TopKCodec, payloads: Tensor, weights: list[float], numel: int,
              rule: str = "mean", clip=None) -> Tensor:
    """Combine R workers' payloads (rows of ``payloads``) into one dense fp32 tensor.

    ``mean``: ``sum_r w_r deQ_r`` (with weights summing to 1 this is SparseLoCo's sum / R for
    equal weights). ``contributors``: per value, ``sum_r w_r deQ_r / sum_{r that sent it} w_r``
    (the public templar code's per-coordinate mean over the workers that sent the value;
    0 where none did). Rows of weight 0 are skipped; rows are added in order, so every replica
    that combines the same payloads gets the same bits. ``codec`` may be any codec with
    ``decode_sparse`` (acco_loco/tiled_topk.py TiledTopK). ``clip``: (segment of each position,
    number of segments) to scale each row per segment to the median row norm first
    (:func:`clip_to_median`); None = no clip."""
    if rule not in ("mean", "contributors"):
        raise ValueError(f"unknown aggregation rule {rule!r}: choose 'mean' or 'contributors'")
    out = torch.zeros(numel, dtype=torch.float32, device=payloads.device)
    senders = torch.zeros(numel, dtype=torch.float32, device=payloads.device) if rule == "contributors" else None
    rows = [(codec.decode_sparse(row, numel), weight) for row, weight in zip(payloads, weights) if weight != 0]
    if clip is not None:
        clipped = clip_to_median([r for r, _ in rows], *clip)
        rows = [(r, w) for r, (_, w) in zip(clipped, rows)]
    for (pos, values), weight in rows:
        # positions are unique within a payload, so each value gets at most one add per row (a
        # plain add, the same on every device and run); the rows are added in order
        out.index_add_(0, pos, values * weight)
        if senders is not None:
            senders.index_add_(0, pos, torch.full_like(values, weight))
    if senders is not None:
        out = torch.where(senders > 0, out / torch.where(senders > 0, senders, torch.ones_like(senders)), out)
    return out


def clip_to_median(rows: list[tuple[Tensor, Tensor]], segment: Tensor, segments: int) -> list[tuple[Tensor, Tensor]]:
    """Each row (positions, values) of a peer, scaled per segment by min(1, median norm / (its norm + eps)),
    the median taken per segment over the rows given (templar's median-norm clip, acco_loco/tiled_topk.py)."""
    if not rows:
        return rows
    norms = torch.stack([segment_sums(segment[p], v * v, torch.zeros(segments, dtype=torch.float32, device=v.device))
                         for p, v in rows]).sqrt()
    median = norms.median(dim=0).values
    factor = (median / (norms + CLIP_EPS)).clamp(max=1.0)
    return [(p, v * factor[r][segment[p]]) for r, (p, v) in enumerate(rows)]


def segment_sums(segment_of: Tensor, values: Tensor, start: Tensor) -> Tensor:
    """``start[j] + sum of values[i] with segment_of[i] == j``, added one after the other in the
    order given, for every segment j < len(start): the bits of ``start.index_add_(0, segment_of,
    values)`` on a CPU, whose 1-D kernel adds in that order, but in a fixed order on every device
    (CUDA's ``index_add_`` adds with atomics, in whatever order the threads come, so two replicas
    could get different sums from the same payloads). The running totals go first, each before
    its segment's values; a stable sort groups the values by segment keeping their order, and
    ``torch.segment_reduce`` sums each group (in one thread on a CPU, a fixed tree on CUDA). No
    host read: the group lengths come from ``searchsorted``."""
    if values.dtype != start.dtype or segment_of.shape != values.shape or start.dim() != 1:
        raise ValueError(f"segment_sums: values {values.dtype} {tuple(values.shape)} need one segment each "
                         f"(got {tuple(segment_of.shape)}) and a 1-D start of the same dtype (got {start.dtype} "
                         f"{tuple(start.shape)})")
    segments = start.numel()
    ids = torch.cat([torch.arange(segments, device=values.device, dtype=torch.int64), segment_of.to(torch.int64)])
    sorted_ids, order = torch.sort(ids, stable=True)
    data = torch.cat([start, values])[order]
    bounds = torch.searchsorted(sorted_ids, torch.arange(segments + 1, device=values.device, dtype=torch.int64))
    return torch.segment_reduce(data, "sum", lengths=bounds.diff(), unsafe=True)
