"""Bytes per GPU of the training state (activations: engine/planner/activations.py), from
docs/design/zero1.md, docs/local_steps.md and docs/onebit_adam.md: memory per parameter. Each
strategy names the formula its state follows (its spec's ``MemorySpec``,
engine/strategies/spec.py); the numbers are here, one function per formula.

Per trainable parameter, e = compute dtype bytes, N = ranks sharing the optimizer, g = codec group,
G = ranks per node:

    replicated        16: fp32 parameters, fp32 gradients, AdamW's two moments (torch DDP, AMP)
    sharded           4e (compute parameters, gathered buffer, two gradient buffers)
                      + 12/N (fp32 master and moments) + 12/N (the step's proposal, transient)
                      + 4/N per kept shard + with a codec 2 (1 + 4/g) (int8 error, its rollback
                      copy), over the rank's 1/G slice when the exchange is two-level
    sharded, model sharded over the node (model_sharding="node", FSDP2 on the node's G ranks):
                      e/G parameters and e/G gradients (FSDP2's local shards), each once more for
                      an overlapping strategy (the comm side's gradient copy, the parameters
                      arriving while compute runs on the old ones), the optimizer's 24/N + 4/N
                      per kept shard with N = G x M, the codec's error on the rank's 1/G slice;
                      plus FSDP2's unsharded block (the one in use and the one prefetched), 2 e P/L
    whole             37 + 4/N fp32, 33 + 4/N bf16 (after the freeze: m, v_T, e_w whole)
    local             4e + 24 (full-size inner AdamW state, theta_sync, s_w, momentum / error);
                      two-level: the node's G ranks shard all of it but the compute buffers: 4e + 24/G
Frozen parameters: e each (a copy in the compute dtype); 1/G of that under node sharding."""

from __future__ import annotations

from dataclasses import dataclass

from engine.strategies.spec import MemorySpec, WireSettings
from engine.topology import Layout

from .modes import Mode
from .shape import ModelShape


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    codec_state: float  # error feedback, local-step state, 1-bit Adam's whole buffers

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.codec_state


def replicated(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    pt, frozen = shape.trainable, shape.params - shape.trainable
    return Memory(4 * pt + ws.compute_bytes * frozen, 4 * pt, 8 * pt, 0.0)


def sharded(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    e, n, g = ws.compute_bytes, layout.world, layout.ranks_per_node
    pt, frozen = shape.trainable, shape.params - shape.trainable
    opt = (24 + 4 * spec.kept_shards) * pt / n
    ef = 0.0
    if mode.codec != "none":
        slice_ = pt / g if mode.exchange == "two-level" else pt
        ef = 2 * slice_ * (1 + 4 / ws.group_size)
    if mode.sharding == "node":
        copies = 2 if mode.overlap else 1
        block = 2 * e * shape.params / shape.layers  # FSDP2's unsharded block in use and the one prefetched
        return Memory(copies * e * pt / g + e * frozen / g + block, copies * e * pt / g, opt, ef)
    return Memory(2 * e * pt + e * frozen, 2 * e * pt, opt, ef)


def whole(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    e, n = ws.compute_bytes, layout.world
    pt, frozen = shape.trainable, shape.params - shape.trainable
    per = (37 if e == 4 else 33) + 4 / n
    return Memory(2 * e * pt + e * frozen, 2 * e * pt, 0.0, (per - 4 * e) * pt)


def local(spec: MemorySpec, mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings) -> Memory:
    e = ws.compute_bytes
    pt, frozen = shape.trainable, shape.params - shape.trainable
    share = layout.ranks_per_node if mode.exchange == "two-level" else 1
    return Memory(2 * e * pt + e * frozen, 2 * e * pt, 12 * pt / share, 12 * pt / share)


FORMULAS = {"replicated": replicated, "sharded": sharded, "whole": whole, "local": local}
REFERENCE = MemorySpec("replicated")  # torch DDP, the planner's reference


def memory_per_gpu(mode: Mode, shape: ModelShape, layout: Layout, ws: WireSettings | None = None) -> Memory:
    spec = REFERENCE if mode.is_ddp else mode.spec.memory
    if spec.state not in FORMULAS:
        raise ValueError(f"memory formula {spec.state!r} of {mode.strategy!r}: choose one of {sorted(FORMULAS)}")
    return FORMULAS[spec.state](spec, mode, shape, layout, ws or WireSettings())
