"""The ``outer`` section: what the local-step strategies diloco and sparseloco share
(docs/local_steps.md): how many inner steps between outer rounds, the outer lr, overlap, the period and
where the outer state lives. Each
also reads a section of its own (diloco_config.py, sparseloco_config.py). Registered by name in
engine/strategies/__init__.py ``SECTIONS``; no torch and no runtime here, so that the config
lists and checks these settings without importing the strategies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..rules import Rule, boolean, choice, integer, number, optional, setting

OUTER_STATE_DEVICES = ("device", "cpu")


@dataclass
class OuterConfig:
    """Every worker takes inner optimizer steps alone, and an outer round merges them every
    inner_steps steps (the recipes' help prefixes each setting with the strategies that read it)."""

    inner_steps: int = setting(15, "inner optimizer steps each worker takes alone between outer rounds (H)")
    outer_lr: float = setting(0.7, "learning rate of the outer step on the averaged pseudo-gradient "
                              "(DiLoCo's 0.7)")
    outer_overlap: bool = setting(False, "keep taking inner steps while the outer round travels, and merge "
                                  "its result one round later")
    outer_period_s: float | None = setting(None, "an outer round every this many seconds instead of every "
                                           "inner_steps (mixed-speed workers; weighted by samples); none = "
                                           "every inner_steps")
    outer_state_device: str = setting("device", "where theta_sync, the outer momentum and the error feedback live: "
                                      "device = beside the model; cpu = host memory, as INTELLECT-1 keeps them "
                                      "(the pseudo-gradient is formed on the host from the local shard, copied "
                                      "over in pieces; each outer round costs two copies of it)")

    # one rule per field (engine/rules.py): EngineConfig checks every value with it
    RULES: ClassVar[dict[str, Rule]] = {
        "inner_steps": integer(1),
        "outer_lr": number(0, low_open=True),
        "outer_overlap": boolean,
        "outer_period_s": optional(number(0, low_open=True), "every inner_steps"),
        "outer_state_device": choice(OUTER_STATE_DEVICES),
    }
