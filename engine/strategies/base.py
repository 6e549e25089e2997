"""The strategy interface: what one round does, and what a strategy keeps between rounds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from acco_loco.acco import RoundPlan

from ..core.rounds import RoundContext, RoundRequest, RoundResult

RECUT_RULES = ("shard", "shared", "summed", "local", "step")


@dataclass(frozen=True)
class Recut:
    """How one tensor of a checkpoint is re-cut for another world size (engine/checkpoint/reshard.py applies
    it; docs/elastic.md, "Checkpoints"):

      shard   one piece per owner: concatenated in rank order, re-padded, cut for the new owners
      shared  what every replica holds alike: rank 0's, re-padded (the padding: ``fill``)
      summed  error feedback: the sum over the old workers kept, spread evenly over the new
      local   a worker's own: new rank r keeps old rank r's; a new worker takes rank 0's
              ``new_from`` tensor, or with none old rank r mod N's
      step    state of a step in progress: refused (resume at the same world size)"""

    rule: str
    fill: float | bool = 0
    new_from: str | None = None

    def __post_init__(self) -> None:
        if self.rule not in RECUT_RULES:
            raise ValueError(f"unknown re-cut rule {self.rule!r}: one of {RECUT_RULES}")


class Strategy:
    """One data-parallel strategy. ``plan`` says how many rounds make an optimizer step and
    whether compute overlaps them; ``run_round`` is a round's whole data path (it runs on the
    comm thread and touches only ``ctx`` and the strategy's own state)."""

    plan: RoundPlan
    # whether its rounds run the two-level exchange when the layout asks for it (engine/parallel/topology.py)
    two_level = False
    # the config sections of engine/strategies/__init__.py SECTIONS that it reads: set away from
    # their defaults under a strategy that does not read them, EngineConfig refuses them
    sections: tuple[str, ...] = ()
    # why its rounds cannot run on FSDP2's local shards (model_sharding='node', engine/parallel/sharding.py);
    # None: they can
    node_sharding_refused: str | None = "its rounds work on the whole parameter buffer"
    # how its checkpointed tensors are re-cut at another world size, by name or by a prefix ending
    # in "." (the longest match wins): the optimizer's ``opt.*`` and what ``state_dict`` returns
    recut_rules: dict[str, Recut] = {"opt.": Recut("shard")}
    # why an optimizer that steps whole matrices (optimizer='muon') cannot run under it; None: it can
    whole_matrices_refused: str | None = "its rounds do not step an owner's whole shard"

    def run_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        raise NotImplementedError

    def overlaps(self, step: int) -> bool:
        """Whether compute goes on beside the rounds of committed step ``step`` (0-based)."""
        return self.plan.overlap

    @classmethod
    def spec(cls):
        """What the planner needs to know (engine/strategies/spec.py ``StrategySpec``); None: the
        planner leaves the strategy out of its table."""
        return None

    @classmethod
    def check(cls, cfg) -> None:
        """Refuse a configuration this strategy cannot honour (called when the engine is built)."""

    @classmethod
    def codec_groups(cls, cfg) -> list[int]:
        """Group sizes this strategy's own wire codecs need every shard to be a multiple of
        (engine/strategies/__init__.py ``shard_groups`` adds them to the configured codecs')."""
        return []

    def make_loop(self, parts):
        """The compute loop that drives this strategy's rounds (engine/loops/), built from the
        engine's parts (``engine.loops.parts.LoopParts``): sharded rounds."""
        from ..loops.sharded import ShardedLoop  # the runtime loads only when an engine is built

        return ShardedLoop(parts)

    @classmethod
    def check_global_batches(cls, cfg) -> None:
        """Refuse a GlobalBatches stream (one stream dealt out per round) if the loop cannot deal it."""

    def initial_values(self, flat, full32: torch.Tensor, rank: int, layout) -> torch.Tensor:
        """The fp32 values this rank's optimizer owns at the start, cut from every replica's
        ``full32`` (the padded flat buffer): its shard by default. ``layout``: the node layout when
        the exchange is two-level (engine/parallel/topology.py), None when it is flat."""
        return flat.shard(full32, rank)

    def setup(self, ctx: RoundContext) -> None:
        """Allocate what the strategy keeps between rounds, once the context exists."""

    def state_dict(self, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON-able metadata) the strategy keeps between rounds, for a checkpoint."""
        return {}, {}

    def load_state_dict(self, ctx: RoundContext, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        pass

    @classmethod
    def recut_rule(cls, key: str) -> Recut | None:
        """The rule of ``recut_rules`` for the checkpoint tensor ``key`` (None: it has none)."""
        matches = [k for k in cls.recut_rules if k == key or (k.endswith(".") and key.startswith(k))]
        return cls.recut_rules[max(matches, key=len)] if matches else None

    @classmethod
    def recut_refusal(cls, meta: dict) -> str | None:
        """Why a checkpoint with this strategy's ``meta`` (rank 0's) cannot be re-cut, or None."""
        return None
