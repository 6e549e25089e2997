"""A codec added from outside the package as one file plus one registration line
(tests/toy_codec.py): the registry takes it in one place; tests/engine/test_extensibility.py
trains it in a gloo group of 2 against a float64 reference."""

from __future__ import annotations

import pytest

import tests.toy_codec  # noqa: F401  (registers 'toy_bf16')
from acco_loco.registry import CODEC_BITS, GRAD_CODECS, WIRE_CODECS, make_codec, register_wire_codec
from engine import EngineConfig


def test_registration_is_one_line_in_one_table():
    assert WIRE_CODECS["toy_bf16"].bits == 16 and "toy_bf16" in GRAD_CODECS
    assert make_codec("toy_bf16").wire_bytes(10) == 20
    assert CODEC_BITS["int4"] == 4 and "toy_bf16" not in CODEC_BITS  # the built-ins, listed at import
    EngineConfig(codec="toy_bf16")  # the config's check reads the registry
    with pytest.raises(ValueError, match="already registered"):
        register_wire_codec("toy_bf16", 16, tests.toy_codec.Bf16Codec)
    with pytest.raises(ValueError, match="already registered"):
        register_wire_codec("other", 4, tests.toy_codec.Bf16Codec, feedback_suffix="4")  # ef4, loco4 taken
