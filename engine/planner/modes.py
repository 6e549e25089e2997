"""The candidates the planner compares, named as the engine's config spells them.

A ``Mode`` is one (strategy, gradient codec, parameter codec, exchange, model sharding)
combination, or torch DDP (the reference, not an engine strategy). Everything the planner knows
of a strategy comes from its spec (``Strategy.spec()``, engine/strategies/spec.py): its rounds
and overlap, its bytes, its work, its memory. ``candidates`` lists every registered strategy
that has a spec, so a strategy registered later shows in the table with no edit here."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.strategies import STRATEGIES, optimizer_refused, strategy_class
from engine.strategies.spec import StrategySpec

DDP = "torch-ddp"
CODEC_VARIANTS = (("none", "auto"), ("loco4", "auto"), ("loco4", "int8"), ("loco4", "int4"))
SHARDINGS = ("none", "node")
OFFLOADS = ("none", "cpu")  # EngineConfig optimizer_offload (engine/runtime/offload.py)


def spec_of(strategy: str) -> StrategySpec:
    spec = strategy_class(strategy).spec()
    if spec is None:
        raise ValueError(f"strategy {strategy!r} has no planning spec (its class's spec() returns None): "
                         "the planner cannot price it")
    return spec


@dataclass(frozen=True)
class Mode:
    strategy: str  # torch-ddp, or a registered strategy (engine/strategies STRATEGIES)
    codec: str = "none"  # gradient codec (engine cfg.codec)
    param_codec: str = "auto"  # engine cfg.param_codec: auto (compute dtype) | int8 | int4 | float32 | bfloat16
    exchange: str = "flat"  # flat | two-level (docs/nodes.md / issue 22: full precision inside the node)
    ddp_dtype: str = "float32"  # torch DDP's all-reduce dtype (bf16 = the bf16 compress hook)
    inner_steps: int = 15  # local-step strategies: optimizer steps between rounds (H)
    outer_overlap: bool = False  # local-step strategies: the round travels behind the next H steps
    sharding: str = "none"  # model_sharding: none | node (FSDP2 over the node's ranks; two-level only)
    offload: str = "none"  # optimizer_offload: none | cpu (the shard optimizer's state and step on the host)
    outer_state: str = "device"  # local-step strategies: outer_state_device, device | cpu

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding {self.sharding!r}: choose one of {SHARDINGS}")
        if self.sharding == "node" and self.exchange != "two-level":
            raise ValueError("model sharding over the node runs the two-level exchange: set exchange='two-level'")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload {self.offload!r}: choose one of {OFFLOADS}")

    @property
    def is_ddp(self) -> bool:
        return self.strategy == DDP

    @property
    def spec(self) -> StrategySpec:
        return spec_of(self.strategy)

    @property
    def local_steps(self) -> bool:
        return not self.is_ddp and self.spec.local_steps

    @property
    def rounds(self) -> int:
        """Exchanges per optimizer step."""
        return 1 if self.is_ddp else self.spec.rounds

    @property
    def overlap(self) -> bool:
        """Whether compute runs while the round is in flight (local steps: with outer_overlap)."""
        if self.is_ddp:
            return False
        return self.spec.overlap or (self.spec.local_steps and self.outer_overlap)

    @property
    def name(self) -> str:
        if self.is_ddp:
            return f"torch-ddp ({'bf16' if self.ddp_dtype == 'bfloat16' else 'fp32'} ring)"
        parts = [self.strategy]
        if self.local_steps:
            parts[0] += f"-h{self.inner_steps}" + ("+overlap" if self.outer_overlap else "")
        if self.codec != "none":
            parts.append(self.codec)
        if self.param_codec in ("int8", "int4"):
            parts.append(f"{self.param_codec}params")
        name = "+".join(parts)
        tags = (["2-level"] if self.exchange == "two-level" else []) + (["node-sharded"] if self.sharding == "node" else [])
        tags += ["optimizer on CPU"] if self.offload == "cpu" else []
        tags += ["outer state on CPU"] if self.outer_state == "cpu" else []
        return name + (f" [{', '.join(tags)}]" if tags else "")

    def engine_settings(self) -> dict:
        """The EngineConfig keywords that run this mode."""
        if self.is_ddp:
            raise ValueError("torch DDP is the reference, not an engine strategy")
        out = {"strategy": self.strategy, "codec": self.codec, "param_codec": self.param_codec}
        if self.local_steps:
            out.update(inner_steps=self.inner_steps, outer_overlap=self.outer_overlap)
            if self.outer_state != "device":
                out.update(outer_state_device=self.outer_state)
        if self.exchange == "two-level":
            out.update(topology="two_level")
        if self.sharding != "none":
            out.update(model_sharding=self.sharding)
        if self.offload != "none":
            out.update(optimizer_offload=self.offload)
        return out


def runs_with(mode: Mode, optimizer: str) -> bool:
    """Whether the engine steps ``mode`` with ``optimizer`` (EngineConfig's rule,
    engine/strategies ``optimizer_refused``; torch DDP, the reference, takes any)."""
    return mode.is_ddp or optimizer_refused(mode.strategy, optimizer, mode.offload) is None


def candidates(two_level: bool = True, node_sharding: bool | None = None, offload: bool | None = None) -> list[Mode]:
    """Every mode the planner predicts: torch DDP fp32 and bf16; every registered strategy with a
    spec, with no codec, LoCo-4 gradients, and LoCo-4 with int8 or int4 parameter deltas where its
    spec takes codecs; flat and, with ``two_level``, two-level where it has that exchange; and
    model-sharded over the node where it runs so (``node_sharding``, default: with two-level); and
    those model-sharded rows again with the optimizer's state on the CPU where the strategy takes
    it (``offload``, default: with node sharding; the scale where the state is what does not fit)."""
    node_sharding = two_level if node_sharding is None else node_sharding
    offload = node_sharding if offload is None else offload
    out, two, sharded, offloaded = [Mode(DDP), Mode(DDP, ddp_dtype="bfloat16")], [], [], []
    for strategy in STRATEGIES:
        cls = strategy_class(strategy)  # its exchanges: ``two_level``, ``node_sharding_refused``
        spec = cls.spec()
        if spec is None:
            continue
        variants = [Mode(strategy, c, p) for c, p in (CODEC_VARIANTS if spec.codec_variants else CODEC_VARIANTS[:1])]
        out += variants
        if two_level and cls.two_level:
            two += [replace(m, exchange="two-level") for m in variants]
        if two_level:  # model sharding over the node runs the two-level layout, whatever the strategy's exchange
            if node_sharding and cls.node_sharding_refused is None:
                sharded += [replace(m, exchange="two-level", sharding="node") for m in variants]
                if offload and getattr(cls, "offload_refused", "no") is None:
                    offloaded += [replace(m, exchange="two-level", sharding="node", offload="cpu") for m in variants]
                if offload and spec.local_steps:  # the outer state on the CPU, as INTELLECT-1 keeps it; and the
                    # inner state too: the device then holds the compute parameters and one gradient buffer
                    offloaded += [replace(m, exchange="two-level", sharding="node", outer_state="cpu") for m in variants]
                    offloaded += [replace(m, exchange="two-level", sharding="node", outer_state="cpu", offload="cpu")
                                  for m in variants]
    return out + two + sharded + offloaded


def auto_strategies() -> tuple[str, ...]:
    """What strategy="auto" may choose: the registered strategies whose update is AdamW's (or AdamW's
    one step late) and that take codecs, never local steps."""
    return tuple(s for s in STRATEGIES if (spec := strategy_class(s).spec()) is not None
                 and spec.adamw_class and not spec.local_steps)
