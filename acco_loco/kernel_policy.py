"""Where the fused CPU kernels (acco_loco/kernels.py) run instead of the torch code beside them:
one place decides, for the gradient reducer, the delta parameter gatherer and the shard
optimizer. The kernels give the same bits as the torch code (acco_loco/kernel_check.py), so the
decision changes speed only.

They run when they are built and pass their self-check (``kernels.available``: not on a CUDA
node unless asked), on fp32 tensors that are on the CPU and contiguous, for what they implement:
int8/int4/int2 codecs with fp32 scales and groups of at most ``kernels.MAX_GROUP``, deterministic
rounding, an error state stored as int8 in the codec's groups, and AdamW."""

from __future__ import annotations

import torch

from . import kernels
from .int_codec import IntCodec


def fits(*tensors: torch.Tensor) -> bool:
    """fp32 tensors the kernels take (on the CPU, contiguous)."""
    return all(t.dtype == torch.float32 and kernels.fits(t) for t in tensors)


def wire_codec(codec) -> bool:
    """A wire codec the kernels implement."""
    return (isinstance(codec, IntCodec) and codec.scale_dtype == torch.float32
            and codec.group_size <= kernels.MAX_GROUP and kernels.available())


def reducer(codec, feedback, generator, device) -> bool:
    """The compressed reduce-scatter's encode and decode (per call also ``fits`` of the gradient)."""
    return (torch.device(device).type == "cpu" and wire_codec(codec) and generator is None
            and (not feedback.active or (feedback.storage == "int8" and feedback.group_size == codec.group_size)))


def optimizer(spec, grad_sum: torch.Tensor, *states) -> bool:
    """The shard optimizer's step (``states``: ShardStates read or written)."""
    return (spec.name == "adamw" and fits(grad_sum, *[t for s in states for t in s.tensors().values()])
            and kernels.available())
