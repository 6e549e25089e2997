"""What a strategy tells the planner about itself (torchtitan's ``TrainSpec`` is the model): its
round plan, the bytes one round sends per rank, its comm-side work per round and which
per-parameter state formula its memory follows. Each strategy class returns one from its
``spec`` classmethod; ``python -m engine.plan`` reads them and names no strategy, so a strategy
registered later (tests/toy_strategy.py) shows in its table with no planner edit.

The byte functions count what one rank sends through ``Comm`` in one round of a flat exchange
over ``world`` ranks, split by collective, so that the planner can put each part on the link it
crosses (engine/planner/wire.py): ``all_to_all`` (rows to every other rank: the reduce-scatter),
``all_gather`` (one piece to every other rank, as a ring gathers it) and ``small`` (the round's
float64 all-reduce of counts, losses and flags). No torch here: the planner imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.dtypes import grad_buffers_fp32, gradient_travels_uncompressed

ALIGN = 128  # EngineConfig.align
STEP_COPIES = ("auto", "whole", "piece")  # EngineConfig step_copy
ERROR_AFTER_SKIP = ("auto", "rollback", "reset")  # EngineConfig error_after_skip


def resolve_step_copy(step_copy: str, cuda: bool, optimizer: str = "adamw") -> str:
    """'whole' or 'piece': where a sharded round proposes its step (EngineConfig step_copy). auto:
    a piece-sized scratch on a GPU, where memory is what runs out (the commit round's second
    optimizer pass is cheap there), the whole spare elsewhere (a CPU's comm side paces the round)
    and for Muon, whose whole matrices reach past a piece."""
    if step_copy not in STEP_COPIES:
        raise ValueError(f"step_copy {step_copy!r}: choose one of {STEP_COPIES}")
    if step_copy == "auto":
        return "piece" if cuda and optimizer != "muon" else "whole"
    return step_copy


def resolve_error_after_skip(setting: str, cuda: bool) -> str:
    """'rollback' or 'reset': what a skipped step does to the gradient codec's error feedback
    (EngineConfig error_after_skip). rollback restores the error from a copy taken at the step's
    start (a second error state: 1 + 4/g bytes per value); reset zeroes it, as the periodic reset
    does, and keeps no copy. auto: reset on a GPU, where memory is what runs out and a skipped
    step is rare (a non-finite gradient), rollback elsewhere."""
    if setting not in ERROR_AFTER_SKIP:
        raise ValueError(f"error_after_skip {setting!r}: choose one of {ERROR_AFTER_SKIP}")
    if setting == "auto":
        return "reset" if cuda else "rollback"
    return setting


def padded(numel: int, world: int, unit: int) -> int:
    """``numel`` rounded up to whole ``unit``-sized pieces for each of ``world`` ranks."""
    step = world * unit
    return -(-numel // step) * step


def small_bytes(world: int, values: int) -> int:
    """One rank's bytes of a ring all-reduce of ``values`` float64 values (Comm's count)."""
    return 2 * (world - 1) * 8 * values // world


@dataclass(frozen=True)
class WireSettings:
    """The settings a round's bytes depend on, besides the strategy and its codecs (and
    step_copy and the optimizer, which only its memory and work depend on)."""

    compute_bytes: int = 4  # 4 = fp32, 2 = bf16
    group_size: int = 128
    scale_dtype: str = "float32"
    topk_density: float = 0.02  # the top-k pseudo-gradient codec's (EngineConfig topk_*)
    topk_chunk: int = 4096
    topk_bits: int = 2
    pseudo_grad_bytes: int = 4  # the pseudo-gradient average's dtype bytes (pseudo_grad_dtype)
    grad_dtype: str = "auto"  # EngineConfig grad_dtype (engine/core/dtypes.py): auto | float32 | compute
    step_copy: str = "auto"  # EngineConfig step_copy (``resolve_step_copy``): auto | whole | piece
    error_after_skip: str = "auto"  # EngineConfig error_after_skip (``resolve_error_after_skip``)
    optimizer: str = "adamw"  # EngineConfig optimizer: Muon proposes into the whole spare (``resolve_step_copy``)

    def grad_bytes(self, mode) -> int:
        """Bytes of a gradient value in ``mode``'s gradient buffers (a planner Mode: its sharding,
        codec and strategy), which an uncompressed gradient also travels in (the engine's rule,
        engine/core/dtypes.py)."""
        fp32 = grad_buffers_fp32(self.grad_dtype, self.compute_bytes == 4, mode.sharding == "node",
                                 gradient_travels_uncompressed(mode.codec, mode.local_steps))
        return 4 if fp32 else self.compute_bytes


@dataclass(frozen=True)
class MemorySpec:
    """Which per-parameter state formula of engine/planner/memory.py the strategy's state follows:

    - ``sharded``: fp32 master and AdamW moments sharded over the optimizer's ranks, the compute
      copy and gradient buffers whole (or, with model sharding, 1/G of them);
    - ``whole``: the compressed stage keeps full-size fp32 state on every rank (1-bit Adam's);
    - ``local``: every replica steps its own copy (inner AdamW and the outer round's buffers);
    - ``replicated``: every rank keeps an fp32 copy of everything and steps it itself;
    - ``replica``: every replica keeps its own parameters and steps them with stateless SGD.

    ``kept_shards``: fp32 shard-sized buffers the strategy keeps between rounds of a step.
    ``piece``: values a round's encodes and decodes take at a time, its temporaries' length ('whole';
    0: whole buffers)."""

    state: str
    kept_shards: int = 0
    piece: int = 0


@dataclass(frozen=True)
class StrategySpec:
    rounds: int  # rounds per optimizer step (local steps: per outer round)
    overlap: bool  # compute runs while a round is in flight (each round behind 1/rounds of a step)
    memory: MemorySpec
    # (numel, world, mode, ws) -> {"all_to_all", "all_gather", "small"}: one round's bytes per rank
    # over a flat group of ``world`` ranks; ``mode`` carries codec, param_codec, inner_steps
    round_parts: Callable[..., dict]
    # (numel, slice_, shard, mode) -> {Hardware cost attribute: values}: a round's comm-side work,
    # ``slice_`` the values this rank exchanges (numel / G when two-level), ``shard`` the values its
    # optimizer owns
    work: Callable[..., dict] = lambda numel, slice_, shard, mode: {}
    # rounds per step that install a proposed step (the sharded round's commits): under step_copy
    # 'piece' each steps the shard's optimizer once more, in place (engine/strategies/sharded.py)
    installs: int = 0
    adamw_class: bool = False  # its update is AdamW's (or AdamW's one step late): auto may take it
    codec_variants: bool = False  # takes gradient codecs and low-bit parameter deltas
    local_steps: bool = False  # a round every ``inner_steps`` optimizer steps taken alone
    outer_cost: str = ""  # local steps: the Hardware cost attribute of an outer round, per value
    warmup_as: str = ""  # a registered strategy whose rounds its warmup runs (time to loss)
    # its update applies a one-step-old gradient with no correction: the decision rule never takes it
    stale_update: bool = False


def sharded_round_parts(numel: int, world: int, mode, ws: WireSettings) -> dict:
    """One round of the sharded exchange (engine/parallel/comm.py, docs/design/wire.md and zero1.md), per rank, S =
    P / N of the padded buffer: reduce-scatter (N-1) S e_g (e_g the gradient's bytes, ``grad_bytes``),
    or (N-1)(wire_bytes(S) + 4) under a gradient codec (+ its 4-byte count weight); all-gather
    (N-1) S e_p, or (N-1) wire_bytes(S) of low-bit deltas; the small all-reduce of 4 + 3N values."""
    from acco_loco.registry import parse_codecs

    codecs = parse_codecs(mode.codec, mode.param_codec, ws.group_size, ws.scale_dtype)
    p = padded(numel, world, codecs.unit(ALIGN))
    s = p // world
    grad = codecs.grad_wire
    rs = (world - 1) * (s * ws.grad_bytes(mode) if grad is None else grad.wire_bytes(s) + 4)
    ag = (world - 1) * codecs.param_wire_bytes(s, ws.compute_bytes)
    return {"all_to_all": rs, "all_gather": ag, "small": small_bytes(world, 4 + 3 * world)}


def sharded_work(numel: int, slice_: int, shard: float, mode) -> dict:
    """A sharded round's comm-side work: copies of the whole buffer, the optimizer on the shard,
    and per codec a pass over the exchanged values (encode + error feedback, decode + sum; low-bit
    deltas: encode the shard, decode every replica's)."""
    from acco_loco.registry import PARAM_DELTA_CODECS

    passes = 2 * slice_ if mode.codec != "none" else 0
    deltas = shard + numel if mode.param_codec in PARAM_DELTA_CODECS else 0
    return {"round_s_per_param": numel, "shard_opt_s_per_param": shard, "codec_s_per_param": passes + deltas}
