"""A toy wire codec added from outside the package: one file plus one registration line (the
last line here). It sends each value as bfloat16 (round to nearest even): 2 bytes a value, no
scales, no groups, on the cast codec's code (acco_loco/fp16_codec.py).
tests/engine/test_toy_codec.py trains with it against a float64 reference."""

from __future__ import annotations

import torch

from acco_loco.fp16_codec import CastCodec
from acco_loco.registry import register_wire_codec


class Bf16Codec(CastCodec):
    name, bits, wire_dtype = "toy_bf16", 16, torch.bfloat16

    def __init__(self, *args, **kwargs) -> None:  # the registry passes name, bits, group size, scales
        super().__init__()


register_wire_codec("toy_bf16", 16, Bf16Codec)  # the registry line: gradient codec 'toy_bf16'
