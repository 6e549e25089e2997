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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .codecs import Codec


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


def frozen_denominator(exp_avg_sq: Tensor, frozen_step: int, spec) -> Tensor:
    """AdamW's denominator at the freeze, sqrt(v_T) / sqrt(1 - beta2^T) + eps (adamw.py's ops),
    used unchanged from then on: a new tensor."""
    return exp_avg_sq.sqrt().div_(math.sqrt(1 - spec.betas[1] ** frozen_step)).add_(spec.eps)


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


def decode_rows(rows: Tensor, codec: Codec, numel: int, mask: Tensor, out: Tensor) -> Tensor:
    """Every owner's row decoded into its shard of ``out`` (N x numel values), 0 where ``mask``."""
    for j in range(rows.shape[0]):
        payload, scales = row_parts(rows[j], codec, numel)
        codec.decode(payload, scales, out=out[j * numel:(j + 1) * numel])
    return out.masked_fill_(mask, 0.0)


def apply_update(master: Tensor, momentum: Tensor, denominator: Tensor, mask: Tensor, lr: float, step: int,
                 spec, out: Tensor) -> Tensor:
    """theta (1 - lr wd) - lr / (1 - beta1^step) * m / d into ``out`` (AdamW's ops and bias
    correction of the momentum, with the frozen denominator d); masked values keep theta."""
    torch.mul(master, 1 - lr * spec.weight_decay, out=out)
    out.addcdiv_(momentum, denominator, value=-lr / (1 - spec.betas[0] ** step))
    return torch.where(mask, master, out, out=out)
