"""1-bit Adam's math (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed", ICML 2021) on flat fp32 tensors: pure functions, no process groups
(the round that moves the bytes is engine/strategies/onebit_adam.py; docs/onebit_adam.md).

After an AdamW warmup the second moment v is frozen at step T and one step k of the compressed
stage is, for N workers with gradient sums x_w over c_w micro-batches (C = sum c_w), the shared
momentum m, the worker errors e_w and the owners' server errors e_s::

    u_w  = x_w * N * coef / C                  (the average of the u_w is the count-weighted mean)
    h_w  = beta1 m + (1 - beta1) u_w + e_w      every worker, full size
    q_w  = Q(h_w);  e_w = h_w - deQ(q_w)        sign x RMS per group (sign1), 1 bit a value
    a    = (1/N) sum_w deQ(q_w)                 each owner, on its shard, in rank order
    q_s  = Q(a + e_s);  e_s = a + e_s - deQ(q_s)
    m    = deQ(q_s)                             every worker decodes every owner's shard
    theta = theta (1 - lr wd) - lr / (1 - beta1^k) * m / d,   d = sqrt(v_T) / sqrt(1 - beta2^T) + eps

Values whose frozen variance is exactly 0 (never had a gradient: unused parameters, padding) are
masked: m, e_w and e_s stay 0 there and theta does not move (sign(0) = +1 would move it).

v is frozen, so d is too: it is formed once, at the freeze, and kept in v's place. The round's
encodes and decodes (``encode_rows``, ``server_round``, ``decode_rows``) take a piece of whole
groups at a time, byte for byte the whole buffer's (each group is encoded and decoded alone), so
a round's temporaries are a piece long, not a buffer long.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .codecs import Codec

PIECE = 1 << 20  # values an encode or a decode of the compressed round takes at a time (whole groups)


# ------------------------------------------------------------------ when to freeze
def variance_settled(step: int, norms: list[float], window: int, tolerance: float, min_steps: int) -> bool:
    """The variance rule: after AdamW step ``step``, with ``norms`` the L1 norms of the
    bias-corrected second moment after the last applied steps (newest last), v counts as stable
    when ``step >= max(min_steps, window)`` and its norm moved by at most ``tolerance`` (relative)
    over the last ``window`` steps."""
    if step < max(min_steps, window) or len(norms) <= window:
        return False
    old, new = norms[-1 - window], norms[-1]
    return abs(new - old) <= tolerance * old


def corrected_l1(exp_avg_sq: Tensor, step: int, beta2: float) -> Tensor:
    """sum |v| / (1 - beta2^step), float64, 0-d: the estimate of sum E[g^2] the rule watches (the
    raw v still grows as 1 - beta2^k for thousands of steps and would never look stable)."""
    return exp_avg_sq.sum(dtype=torch.float64) / (1 - beta2**step)


# ------------------------------------------------------------------ the frozen denominator
def unused_mask(exp_avg_sq: Tensor) -> Tensor:
    """True where the second moment is exactly 0 at the freeze: the value never had a gradient."""
    return exp_avg_sq == 0


def frozen_denominator(exp_avg_sq: Tensor, frozen_step: int, spec, out: Tensor | None = None) -> Tensor:
    """AdamW's denominator at the freeze, sqrt(v_T) / sqrt(1 - beta2^T) + eps (adamw.py's ops),
    used unchanged from then on: a new tensor, or ``out`` (``exp_avg_sq`` itself: in place)."""
    return torch.sqrt(exp_avg_sq, out=out).div_(math.sqrt(1 - spec.betas[1] ** frozen_step)).add_(spec.eps)


# ------------------------------------------------------------------ one compressed step
def compress_with_error(h: Tensor, codec: Codec, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(payload, scales, new error) for ``h`` = what is meant + the old error: the new error is
    h - deQ(Q(h)) in a new tensor, 0 where ``mask``; ``h`` itself is left as it was."""
    payload, scales, sent = codec.encode_with_decoded(h, check_finite=False)
    return payload, scales, torch.sub(h, sent, out=sent).masked_fill_(mask, 0.0)


def worker_message(momentum: Tensor, contribution: Tensor, worker_error: Tensor, beta1: float) -> Tensor:
    """h_w = beta1 m + (1 - beta1) u_w + e_w, written into ``contribution`` (the round's buffer)."""
    return torch.lerp(momentum, contribution, 1 - beta1, out=contribution).add_(worker_error)


def split_rows(payload: Tensor, scales: Tensor, world: int) -> Tensor:
    """[world, L] uint8: row j = [payload of shard j | its scales' bytes], what owner j receives
    (a shard is a whole number of groups, so its codes and scales are contiguous slices)."""
    raw = scales.contiguous().view(torch.uint8)
    return torch.cat([payload.view(world, -1), raw.view(world, -1)], dim=1)


def row_parts(row: Tensor, codec: Codec, numel: int) -> tuple[Tensor, Tensor]:
    """(payload, scales) of one row of ``numel`` values; the scales are copied when their bytes
    do not start at a multiple of their size (a view needs that)."""
    p = codec.payload_bytes(numel)
    raw = row[p:]
    if raw.storage_offset() % codec.scale_dtype.itemsize:
        raw = raw.clone()
    return row[:p], raw.view(codec.scale_dtype)


def server_average(rows: Tensor, codec: Codec, numel: int) -> Tensor:
    """(1/N) sum over the N received rows, in rank order, of their decoded values (fp32)."""
    out = torch.empty(numel, dtype=torch.float32, device=rows.device)
    for j in range(rows.shape[0]):
        payload, scales = row_parts(rows[j], codec, numel)
        codec.decode(payload, scales, out=out, accumulate=j > 0)
    return out.div_(rows.shape[0])


def decode_rows(rows: Tensor, codec: Codec, numel: int, mask: Tensor, out: Tensor, piece: int = PIECE) -> Tensor:
    """Every owner's row decoded into its shard of ``out`` (N x numel values), 0 where ``mask``;
    ``piece`` values of a row at a time."""
    for j in range(rows.shape[0]):
        for a, b in pieces(numel, piece, codec.group_size):
            codec.decode(*_row_piece(rows[j], codec, numel, a, b), out=out[j * numel + a:j * numel + b])
    return out.masked_fill_(mask, 0.0)


# ------------------------------------------------------------------ the round a piece at a time
def pieces(numel: int, piece: int, group: int) -> list[tuple[int, int]]:
    """The [a, b) pieces of ``numel`` values (whole groups) that are at most ``piece`` long, but
    at least one group."""
    step = max(group, piece // group * group)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def _row_piece(row: Tensor, codec: Codec, numel: int, a: int, b: int) -> tuple[Tensor, Tensor]:
    """(payload, scales) of values [a, b) (whole groups) of a row of ``numel`` values: views where
    the scales' bytes start at a multiple of their size, else the scales copied (``row_parts``)."""
    head = codec.payload_bytes(numel)
    raw = row[head + codec.scale_bytes(a):head + codec.scale_bytes(b)]
    if raw.storage_offset() % codec.scale_dtype.itemsize:
        raw = raw.clone()
    return row[codec.payload_bytes(a):codec.payload_bytes(b)], raw.view(codec.scale_dtype)


def _encode_piece(x: Tensor, codec: Codec, mask: Tensor, row: Tensor, numel: int, a: int, b: int,
                  error: Tensor) -> None:
    """Q(x) (values [a, b) of a row of ``numel``) into its place in ``row``, x - deQ(Q(x)) into
    ``error`` (0 where ``mask``): ``compress_with_error`` and ``split_rows`` on one piece."""
    payload, scales, sent = codec.encode_with_decoded(x, check_finite=False)
    head = codec.payload_bytes(numel)
    row[codec.payload_bytes(a):codec.payload_bytes(b)].copy_(payload)
    row[head + codec.scale_bytes(a):head + codec.scale_bytes(b)].copy_(scales.contiguous().view(torch.uint8))
    torch.sub(x, sent, out=error).masked_fill_(mask, 0.0)


def encode_rows(h: Tensor, codec: Codec, mask: Tensor, rows: Tensor, error: Tensor, piece: int = PIECE) -> Tensor:
    """A worker's message: Q(h) into ``rows`` ([N, L] uint8, ``split_rows``' layout, row j what
    owner j receives) and h - deQ(Q(h)) into ``error`` (0 where ``mask``), ``piece`` values at a
    time; byte for byte ``split_rows(*compress_with_error(h, codec, mask)[:2], N)`` and its error."""
    size = h.numel() // rows.shape[0]
    for j in range(rows.shape[0]):
        for a, b in pieces(size, piece, codec.group_size):
            lo, hi = j * size + a, j * size + b
            _encode_piece(h[lo:hi], codec, mask[lo:hi], rows[j], size, a, b, error[lo:hi])
    return rows


def server_round(received: Tensor, codec: Codec, server_error: Tensor, mask: Tensor, row: Tensor, error: Tensor,
                 piece: int = PIECE) -> Tensor:
    """An owner's part: a = (1/N) sum of the N ``received`` rows decoded, in rank order; Q(a + e_s)
    into ``row`` (its shard's row) and a + e_s - deQ(Q(a + e_s)) into ``error`` (0 where ``mask``),
    ``piece`` values at a time: byte for byte ``server_average`` then ``compress_with_error``."""
    size, n = server_error.numel(), received.shape[0]
    for a, b in pieces(size, piece, codec.group_size):
        mine = torch.empty(b - a, dtype=torch.float32, device=received.device)
        for j in range(n):
            codec.decode(*_row_piece(received[j], codec, size, a, b), out=mine, accumulate=j > 0)
        mine.div_(n).add_(server_error[a:b])
        _encode_piece(mine, codec, mask[a:b], row, size, a, b, error[a:b])
    return row


def apply_update(master: Tensor, momentum: Tensor, denominator: Tensor, mask: Tensor, lr: float, step: int,
                 spec, out: Tensor) -> Tensor:
    """theta (1 - lr wd) - lr / (1 - beta1^step) * m / d into ``out`` (AdamW's ops and bias
    correction of the momentum, with the frozen denominator d); masked values keep theta."""
    torch.mul(master, 1 - lr * spec.weight_decay, out=out)
    out.addcdiv_(momentum, denominator, value=-lr / (1 - spec.betas[0] ** step))
    return torch.where(mask, master, out, out=out)
