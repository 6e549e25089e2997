"""The ``outer`` section: the settings of the local-step strategies diloco and sparseloco
(docs/DESIGN.md section 8), which read it (their class attribute ``sections``). Registered by
name in engine/strategies/__init__.py ``SECTIONS``; no torch and no runtime here, so that the
config lists and checks these settings without importing the strategies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Check, Rule, boolean, choice, integer, is_int, number, optional, setting

OUTER_MOMENTUM_KINDS = ("nesterov", "heavy_ball")
PSEUDO_GRAD_DTYPES = ("float32", "bfloat16")
SPARSE_AGGREGATES = ("mean", "contributors")
TOPK_VALUE_BITS = (1, 2, 4, 8)  # what acco_loco/bitpack.py packs
MAX_TOPK_CHUNK = 2**16  # indices within a chunk fit 16 bits


@dataclass
class OuterConfig:
    """Every worker takes inner optimizer steps alone, and an outer round merges them every
    inner_steps steps (the recipes' help prefixes each setting with the strategies that read it)."""

    inner_steps: int = setting(15, "inner optimizer steps each worker takes alone between outer rounds (H)")
    outer_lr: float = setting(0.7, "learning rate of the outer step on the averaged pseudo-gradient "
                              "(DiLoCo's 0.7)")
    outer_momentum: float = setting(0.9, "momentum of diloco's outer SGD (DiLoCo's 0.9; 0 = none)")
    outer_momentum_kind: str = setting("nesterov", "diloco's outer momentum: nesterov (DiLoCo) or heavy_ball")
    pseudo_grad_dtype: str = setting("float32", "dtype of diloco's pseudo-gradient average on the wire")
    topk_density: float = setting(0.02, "fraction of each chunk's values sparseloco sends (top-k by magnitude)")
    topk_chunk: int = setting(4096, "values per sparseloco top-k chunk (indices take ceil(log2 chunk) bits)")
    topk_value_bits: int = setting(2, "bits per value sparseloco sends (1 sign bit + magnitude bits)")
    sparse_error_beta: float = setting(0.95, "decay of sparseloco's error-feedback accumulator")
    sparse_aggregate: str = setting("mean", "how sparseloco combines the payloads: mean = sum over workers / R "
                                    "(the paper); contributors = per value, the mean over the workers that "
                                    "sent it (templar)")
    outer_overlap: bool = setting(False, "keep taking inner steps while the outer round travels, and merge "
                                  "its result one round later")
    outer_period_s: float | None = setting(None, "an outer round every this many seconds instead of every "
                                           "inner_steps (mixed-speed workers; weighted by samples); none = "
                                           "every inner_steps")

    # one rule per field (engine/rules.py): EngineConfig checks every value with it
    RULES: ClassVar[dict[str, Rule]] = {
        "inner_steps": integer(1),
        "outer_lr": number(0, low_open=True),
        "outer_momentum": number(0, 1, high_open=True),
        "outer_momentum_kind": choice(OUTER_MOMENTUM_KINDS),
        "pseudo_grad_dtype": choice(PSEUDO_GRAD_DTYPES),
        "topk_density": number(0, 1, low_open=True),
        "topk_chunk": Check(f"an integer in [2, {MAX_TOPK_CHUNK}]", lambda v: is_int(v) and 2 <= v <= MAX_TOPK_CHUNK),
        "topk_value_bits": Check(f"one of {TOPK_VALUE_BITS}", lambda v: is_int(v) and v in TOPK_VALUE_BITS),
        "sparse_error_beta": number(0, 1),
        "sparse_aggregate": choice(SPARSE_AGGREGATES),
        "outer_overlap": boolean,
        "outer_period_s": optional(number(0, low_open=True), "every inner_steps"),
    }
