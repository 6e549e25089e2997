"""Config names -> the math they stand for: wire codecs (name, bits a value, the family class
that implements it), the gradient codecs over them (error feedback + wire codec), parameter
codecs and pseudo-gradient codecs. The one table of codec names: a new codec is a file with its
class plus a line here (or a :func:`register_wire_codec` call, as tests/toy_codec.py does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .codecs import SCALE_DTYPES, Codec
from .fp16_codec import Fp16Codec
from .int_codec import IntCodec
from .sign_codec import SignCodec
from .topk_codec import TopKCodec


@dataclass(frozen=True)
class WireCodec:
    """A wire codec by name: ``WIRE_CODECS[name](group_size, scale_dtype)`` builds one."""

    name: str
    bits: int  # per value on the wire, scales not counted
    family: Callable[..., Codec]  # (name=, bits=, group_size=, scale_dtype=) -> codec

    def __call__(self, group_size: int = 128, scale_dtype: torch.dtype | str = torch.float32) -> Codec:
        if isinstance(scale_dtype, str):
            if scale_dtype not in SCALE_DTYPES:
                raise ValueError(f"unknown scale dtype {scale_dtype!r}; valid: {', '.join(SCALE_DTYPES)}")
            scale_dtype = SCALE_DTYPES[scale_dtype]
        return self.family(name=self.name, bits=self.bits, group_size=group_size, scale_dtype=scale_dtype)


@dataclass(frozen=True)
class GradCodecSpec:
    feedback: str  # none | ef (classic error feedback) | loco (LoCo moving average)
    wire: str  # a key of WIRE_CODECS

    def make_wire(self, group_size: int, scale_dtype: str) -> Codec:
        return WIRE_CODECS[self.wire](group_size, scale_dtype)


WIRE_CODECS: dict[str, WireCodec] = {}
GRAD_CODECS: dict[str, GradCodecSpec | None] = {"none": None}


def register_wire_codec(name: str, bits: int, family: Callable[..., Codec], feedback_suffix: str | None = None) -> None:
    """Add wire codec ``name``: gradient codec ``name`` sends it plain; with ``feedback_suffix``
    ``s``, ``ef<s>`` and ``loco<s>`` send it under classic / LoCo error feedback."""
    grad_names = [name] + ([f"ef{feedback_suffix}", f"loco{feedback_suffix}"] if feedback_suffix is not None else [])
    taken = [n for n in grad_names if n in GRAD_CODECS] + ([name] if name in WIRE_CODECS else [])
    if taken:
        raise ValueError(f"codec name(s) {', '.join(taken)} already registered; pick another name")
    WIRE_CODECS[name] = WireCodec(name, bits, family)
    GRAD_CODECS[name] = GradCodecSpec("none", name)
    if feedback_suffix is not None:
        for feedback in ("ef", "loco"):
            GRAD_CODECS[f"{feedback}{feedback_suffix}"] = GradCodecSpec(feedback, name)


# name, bits a value, family; the suffix names its error-feedback variants (ef4, loco4, ...)
register_wire_codec("int8", 8, IntCodec, feedback_suffix="8")
register_wire_codec("int4", 4, IntCodec, feedback_suffix="4")
register_wire_codec("int2", 2, IntCodec, feedback_suffix="2")
register_wire_codec("sign1", 1, SignCodec, feedback_suffix="1")  # sign x group RMS
register_wire_codec("fp16", 16, lambda **_: Fp16Codec())  # a plain half-precision cast, no groups


def codec_bits() -> dict[str, int]:
    """Wire codec name -> bits per value."""
    return {name: codec.bits for name, codec in WIRE_CODECS.items()}


CODEC_BITS = codec_bits()  # the built-in codecs, for tools that list them (benchmarks/codec_bench.py)


def make_codec(name: str, group_size: int = 128, scale_dtype: torch.dtype | str = torch.float32) -> Codec:
    """Build a wire codec by name (``int8``, ``int4``, ``int2``, ``sign1``, ``fp16``, or one
    registered later). ``scale_dtype`` is ``torch.float32``/``torch.bfloat16`` or one of the
    strings ``"fp32"``, ``"float32"``, ``"bf16"``, ``"bfloat16"``."""
    if name not in WIRE_CODECS:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(WIRE_CODECS)}")
    return WIRE_CODECS[name](group_size, scale_dtype)


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
                     "or 1-bit 'sign1' / 'ef1' / 'loco1' (sign x RMS), or 'fp16' (a half-precision cast); "
                     f"registered: {', '.join(GRAD_CODECS)}")


@dataclass(frozen=True)
class CodecChoice:
    """A (gradient codec, parameter codec) pair, parsed once: what the engine builds from it
    (engine/parallel/collectives.py), what it needs of the shard size and what the planner counts."""

    grad: GradCodecSpec | None  # None: the gradient goes at the compute dtype
    param: str  # a PARAM_CODECS name
    group_size: int
    scale_dtype: str | torch.dtype

    @property
    def grad_wire(self) -> Codec | None:
        return None if self.grad is None else self.grad.make_wire(self.group_size, self.scale_dtype)

    @property
    def param_deltas(self) -> bool:
        return self.param in PARAM_DELTA_CODECS

    def param_wire(self) -> Codec | None:
        """The low-bit delta codec of the parameter all-gather (None: a cast)."""
        return WIRE_CODECS[self.param](self.group_size, self.scale_dtype) if self.param_deltas else None

    def param_cast_bytes(self, compute_bytes: int) -> int:
        """Bytes per value of the parameter cast (auto: the compute dtype's)."""
        return {"auto": compute_bytes, "float32": 4, "bfloat16": 2}[self.param]

    def param_wire_bytes(self, values: int, compute_bytes: int) -> int:
        """Bytes of ``values`` parameters on the wire, cast or as low-bit deltas."""
        wire = self.param_wire()
        return values * self.param_cast_bytes(compute_bytes) if wire is None else wire.wire_bytes(values)

    def groups(self) -> list[int]:
        """The group sizes every shard must be a multiple of for these codecs."""
        wire = self.grad_wire
        return ([] if wire is None else [wire.group_size]) + ([self.group_size] if self.param_deltas else [])

    def unit(self, align: int) -> int:
        """The piece each rank's shard is a multiple of (engine/core/context.py pads to it)."""
        import math

        return math.lcm(align, *self.groups())


def parse_codecs(codec: str, param_codec: str = "auto", group_size: int = 128,
                 scale_dtype: str | torch.dtype = "float32") -> CodecChoice:
    """The one parser of the codec names: EngineConfig's ``codec`` and ``param_codec``."""
    if param_codec not in PARAM_CODECS:
        raise ValueError(f"unknown param_codec {param_codec!r}: choose one of {', '.join(PARAM_CODECS)}")
    return CodecChoice(parse_grad_codec(codec), param_codec, group_size, scale_dtype)
