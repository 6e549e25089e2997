"""The ``sparseloco`` section: what only sparseloco reads (its top-k codec and error feedback;
docs/local_steps.md, "The top-k codec and the bytes per round"). The shared local-step settings are the ``outer`` section
(outer_config.py). No torch and no runtime here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Check, Rule, choice, is_int, number, setting

SPARSE_AGGREGATES = ("mean", "contributors")
TOPK_LAYOUTS = ("flat", "tensor")
SPARSE_CLIPS = ("none", "median")
SPARSE_ERROR_SCALES = ("raw", "outer_lr")
TOPK_VALUE_BITS = (1, 2, 4, 8)  # what acco_loco/bitpack.py packs
MAX_TOPK_CHUNK = 2**16  # indices within a chunk fit 16 bits


@dataclass
class SparselocoConfig:
    """sparseloco's pseudo-gradient: chunked top-k of the error-compensated values, low-bit values."""

    topk_density: float = setting(0.02, "fraction of each chunk's values sent (top-k by magnitude)")
    topk_chunk: int = setting(4096, "values per top-k chunk (indices take ceil(log2 chunk) bits)")
    topk_value_bits: int = setting(2, "bits per value sent (1 sign bit + magnitude bits)")
    sparse_error_beta: float = setting(0.95, "decay of the error-feedback accumulator")
    sparse_aggregate: str = setting("mean", "how the payloads combine: mean = sum over workers / R (the "
                                    "paper); contributors = per value, the mean over the workers that sent "
                                    "it (templar)")
    # the options templar's code has (docs/sparseloco.md); defaults from the 20 Mbit/s measurement there
    topk_layout: str = setting("flat", "chunks: flat = the flat buffer cut into topk_chunk values across tensors; "
                               "tensor = each tensor of 2+ dims in sqrt(topk_chunk)-square tiles (templar's 64 x 64), "
                               "1-D tensors sent whole as fp32 (needs topology flat)")
    sparse_clip: str = setting("none", "none, or median = scale each peer's contribution to a tensor down to the "
                               "median peer's norm before combining (templar; needs topology flat)")
    sparse_error_scale: str = setting("raw", "what the error feedback adds: raw = the pseudo-gradient (the paper), "
                                      "outer_lr = outer_lr x it (templar; the outer step is then outer_lr^2 x "
                                      "the raw one's: equal only at outer_lr 1)")

    RULES: ClassVar[dict[str, Rule]] = {
        "topk_density": number(0, 1, low_open=True),
        "topk_chunk": Check(f"an integer in [2, {MAX_TOPK_CHUNK}]", lambda v: is_int(v) and 2 <= v <= MAX_TOPK_CHUNK),
        "topk_value_bits": Check(f"one of {TOPK_VALUE_BITS}", lambda v: is_int(v) and v in TOPK_VALUE_BITS),
        "sparse_error_beta": number(0, 1),
        "sparse_aggregate": choice(SPARSE_AGGREGATES),
        "topk_layout": choice(TOPK_LAYOUTS),
        "sparse_clip": choice(SPARSE_CLIPS),
        "sparse_error_scale": choice(SPARSE_ERROR_SCALES),
    }
