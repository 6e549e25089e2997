"""Config names -> the math they stand for: gradient codecs (error feedback + wire codec) and
parameter codecs. A new codec is a file with its class plus a line in one of these tables."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from .codecs import Codec, make_codec
from .fp16_codec import Fp16Codec
from .topk_codec import TopKCodec

# wire codec name -> factory(group_size, scale_dtype)
WIRE_CODECS: dict[str, Callable[[int, str], Codec]] = {
    "int8": partial(make_codec, "int8"),
    "int4": partial(make_codec, "int4"),
    "int2": partial(make_codec, "int2"),
    "sign1": partial(make_codec, "sign1"),
    "fp16": lambda group_size, scale_dtype: Fp16Codec(),
}


@dataclass(frozen=True)
class GradCodecSpec:
    feedback: str  # none | ef (classic error feedback) | loco (LoCo moving average)
    wire: str  # a key of WIRE_CODECS

    def make_wire(self, group_size: int, scale_dtype: str) -> Codec:
        return WIRE_CODECS[self.wire](group_size, scale_dtype)


def _grad_codecs() -> dict[str, GradCodecSpec | None]:
    table: dict[str, GradCodecSpec | None] = {"none": None}
    for bits in (8, 4, 2):
        table[f"int{bits}"] = GradCodecSpec("none", f"int{bits}")
    table["sign1"] = GradCodecSpec("none", "sign1")
    for feedback in ("ef", "loco"):
        for bits in (8, 4, 2):
            table[f"{feedback}{bits}"] = GradCodecSpec(feedback, f"int{bits}")
        table[f"{feedback}1"] = GradCodecSpec(feedback, "sign1")
    table["fp16"] = GradCodecSpec("none", "fp16")  # a plain half-precision cast
    return table


GRAD_CODECS: dict[str, GradCodecSpec | None] = _grad_codecs()

# parameter all-gather: a cast (auto = the compute dtype) or low-bit deltas against every replica
PARAM_CASTS = ("auto", "float32", "bfloat16")
PARAM_DELTA_CODECS = ("int8", "int4")
PARAM_CODECS = PARAM_CASTS + PARAM_DELTA_CODECS


# pseudo-gradient codecs of the local-step strategies: name -> factory(chunk, density, bits)
PSEUDO_GRAD_CODECS: dict[str, Callable[[int, float, int], TopKCodec]] = {"topk": TopKCodec}


def parse_grad_codec(name: str) -> GradCodecSpec | None:
    """'none' -> None; 'loco4' -> LoCo over the 4-bit wire codec; 'ef8', 'int4', 'sign1', ... ."""
    if isinstance(name, str) and name in GRAD_CODECS:
        return GRAD_CODECS[name]
    raise ValueError(f"unknown codec {name!r}: 'none', or <kind><bits> with kind int (plain), ef "
                     "(classic error feedback) or loco (LoCo moving average) and bits 8, 4 or 2, "
                     "or 1-bit 'sign1' / 'ef1' / 'loco1' (sign x RMS), or 'fp16' (a half-precision cast)")
