"""The candidates the planner compares, named as the engine's config spells them.

A ``Mode`` is one (strategy, gradient codec, parameter codec, exchange) combination, or torch
DDP (the reference, not an engine strategy). ``rounds`` and ``overlap`` come from the
strategy's round plan (docs/DESIGN.md section 1.2); ``local_steps`` marks diloco/sparseloco."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Mode:
    strategy: str  # torch-ddp | zero1 | dpu | acco | onebit_adam | diloco | sparseloco
    codec: str = "none"  # gradient codec (engine cfg.codec)
    param_codec: str = "auto"  # engine cfg.param_codec: auto (compute dtype) | int8 | int4 | float32 | bfloat16
    exchange: str = "flat"  # flat | two-level (docs/DESIGN.md / issue 22: full precision inside the node)
    ddp_dtype: str = "float32"  # torch DDP's all-reduce dtype (bf16 = the bf16 compress hook)
    inner_steps: int = 15  # diloco / sparseloco
    outer_overlap: bool = False

    @property
    def is_ddp(self) -> bool:
        return self.strategy == "torch-ddp"

    @property
    def local_steps(self) -> bool:
        return self.strategy in ("diloco", "sparseloco")

    @property
    def rounds(self) -> int:
        """Exchanges per optimizer step (acco: estimate + commit)."""
        return 2 if self.strategy == "acco" else 1

    @property
    def overlap(self) -> bool:
        """Whether compute runs while the round is in flight (dpu, acco; local steps with
        outer_overlap)."""
        return self.strategy in ("dpu", "acco") or (self.local_steps and self.outer_overlap)

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
        return name + (" [2-level]" if self.exchange == "two-level" else "")

    def engine_settings(self) -> dict:
        """The EngineConfig keywords that run this mode."""
        if self.is_ddp:
            raise ValueError("torch DDP is the reference, not an engine strategy")
        out = {"strategy": self.strategy, "codec": self.codec, "param_codec": self.param_codec}
        if self.local_steps:
            out.update(inner_steps=self.inner_steps, outer_overlap=self.outer_overlap)
        return out


def candidates(two_level: bool = True) -> list[Mode]:
    """Every mode the planner predicts: torch DDP fp32 and bf16; zero1, dpu and acco with no
    codec, LoCo-4 gradients, and LoCo-4 with int8 or int4 parameter deltas; 1-bit Adam; diloco
    and sparseloco (H = 15); the sharded ones flat and, with ``two_level``, two-level."""
    out = [Mode("torch-ddp"), Mode("torch-ddp", ddp_dtype="bfloat16")]
    sharded = []
    for strategy in ("zero1", "dpu", "acco"):
        sharded += [Mode(strategy), Mode(strategy, "loco4"), Mode(strategy, "loco4", "int8"),
                    Mode(strategy, "loco4", "int4")]
    sharded.append(Mode("onebit_adam"))
    local = [Mode("diloco"), Mode("sparseloco")]
    out += sharded + local
    if two_level:
        out += [replace(m, exchange="two-level") for m in sharded + local]
    return out


# what strategy="auto" may choose: the modes that keep synchronous AdamW's loss per sample
AUTO_STRATEGIES = ("zero1", "dpu", "acco")
