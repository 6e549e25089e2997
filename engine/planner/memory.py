"""Bytes per GPU of the training state (activations left out: they depend on the micro-batch
and checkpointing, not on the strategy), from docs/DESIGN.md sections 3.1, 8.5 and 9.5.

Per trainable parameter, e = compute dtype bytes, N = ranks sharing the optimizer, g = group:

    torch DDP (AMP)   16: fp32 parameters, fp32 gradients, AdamW's two moments
    zero1/dpu/acco    4e (compute parameters, gathered buffer, two gradient buffers)
                      + 12/N (fp32 master and moments) + 12/N (the step's proposal, transient)
                      + acco 4/N (the kept half) + with a codec 2 (1 + 4/g) (int8 error, its rollback
                      copy), over the rank's 1/G slice when the exchange is two-level
    onebit_adam       37 + 4/N fp32, 33 + 4/N bf16 (after the freeze: m, v_T, e_w whole)
    diloco/sparseloco 4e + 24 (full-size inner AdamW state, theta_sync, s_w, momentum / error);
                      two-level: the node's G ranks shard all of it but the compute buffers: 4e + 24/G
Frozen parameters: e each (a copy in the compute dtype)."""

from __future__ import annotations

from dataclasses import dataclass

from .modes import Mode
from .shape import ModelShape
from .wire import Layout, WireSettings


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    codec_state: float  # error feedback, local-step state, 1-bit Adam's whole buffers

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.codec_state


def memory_per_gpu(mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings | None = None) -> Memory:
    ws = ws or WireSettings()
    e = ws.compute_bytes
    pt, frozen = shape.trainable, shape.params - shape.trainable
    n, g = layout.world, layout.per_node
    if mode.is_ddp:
        return Memory(4 * pt + e * frozen, 4 * pt, 8 * pt, 0.0)
    if mode.strategy == "onebit_adam":
        per = (37 if e == 4 else 33) + 4 / n
        return Memory(2 * e * pt + e * frozen, 2 * e * pt, 0.0, (per - 4 * e) * pt)
    if mode.local_steps:
        share = g if mode.exchange == "two-level" else 1
        return Memory(2 * e * pt + e * frozen, 2 * e * pt, 12 * pt / share, 12 * pt / share)
    opt = (24 + (4 if mode.strategy == "acco" else 0)) * pt / n
    ef = 0.0
    if mode.codec != "none":
        slice_ = pt / g if mode.exchange == "two-level" else pt
        ef = 2 * slice_ * (1 + 4 / ws.group_size)
    return Memory(2 * e * pt + e * frozen, 2 * e * pt, opt, ef)
