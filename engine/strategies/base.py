"""The strategy interface: what one round does, and what a strategy keeps between rounds."""

from __future__ import annotations

import torch

from acco_loco.acco import RoundPlan

from ..rounds import RoundContext, RoundRequest, RoundResult


class Strategy:
    """One data-parallel strategy. ``plan`` says how many rounds make an optimizer step and
    whether compute overlaps them; ``run_round`` is a round's whole data path (it runs on the
    comm thread and touches only ``ctx`` and the strategy's own state)."""

    plan: RoundPlan
    # whether its rounds run the two-level exchange when the layout asks for it (engine/topology.py)
    two_level = False
    # the config sections of engine/strategies/__init__.py SECTIONS that it reads: set away from
    # their defaults under a strategy that does not read them, EngineConfig refuses them
    sections: tuple[str, ...] = ()
    # why its rounds cannot run on FSDP2's local shards (model_sharding='node', engine/sharding.py);
    # None: they can
    node_sharding_refused: str | None = "its rounds work on the whole parameter buffer"

    def run_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        raise NotImplementedError

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
        the exchange is two-level (engine/topology.py), None when it is flat."""
        return flat.shard(full32, rank)

    def setup(self, ctx: RoundContext) -> None:
        """Allocate what the strategy keeps between rounds, once the context exists."""

    def state_dict(self, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON-able metadata) the strategy keeps between rounds, for a checkpoint."""
        return {}, {}

    def load_state_dict(self, ctx: RoundContext, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        pass
