"""The core sections of EngineConfig, each a dataclass of ``setting(...)`` fields (default and
help) with its ``RULES`` table, one rule per field (engine/rules.py). The strategies' own
sections have the same form, one file each under engine/strategies/ (outer_config.py,
diloco_config.py, sparseloco_config.py, onebit_config.py); engine/config.py gathers them all."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from acco_loco.optim import OPTIMIZERS
from acco_loco.optim import finite_number as _finite
from acco_loco.optimizers import MUON_ADJUST_LR
from acco_loco.registry import GRAD_CODECS, PARAM_CODECS, parse_grad_codec
from acco_loco.schedule import SCHEDULES

from .parallel.topology import TOPOLOGIES
from .rules import Check, Choice, Rule, boolean, choice, integer, is_int, number, optional, setting
from .strategies.spec import ERROR_AFTER_SKIP, STEP_COPIES  # names only: a strategy's module loads when first used

MODEL_SHARDINGS = ("none", "node")

ACCUMULATION_MODES = ("fixed", "grow")
BALANCES = ("equal", "speed")
ERROR_STORAGES = ("int8", "fp32")
SCALE_DTYPES = ("float32", "bfloat16")

_betas = Check("a pair (beta1, beta2) of finite numbers in [0, 1)",
               lambda v: isinstance(v, (tuple, list)) and len(v) == 2
               and all(_finite(b) and 0 <= b < 1 for b in v))

_group_size = Check("a positive multiple of 8", lambda v: is_int(v) and v > 0 and v % 8 == 0)

_checkpoint_dir = Check("None or a non-empty path (a str or os.PathLike)",
                        lambda v: v is None or isinstance(v, (str, os.PathLike))
                        and isinstance(os.fspath(v), str) and os.fspath(v) != "")


class _GradCodecChoice(Choice):
    def __call__(self, name: str, value: Any) -> None:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a codec name such as 'none', 'int8' or 'loco4', got {value!r}")
        parse_grad_codec(value)  # its message lists the valid names



OPTIMIZER_OFFLOADS = ("none", "cpu")  # engine/runtime/offload.py OFFLOADS


@dataclass
class OptimizerConfig:
    """The shard optimizer (one flat fp32 shard per worker)."""

    name: str = setting("adamw", "shard optimizer")  # flat keyword: optimizer
    lr: float = setting(3e-4, "peak learning rate")
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW's (beta1, beta2)")
    eps: float = setting(1e-8, "AdamW's epsilon")
    weight_decay: float = setting(0.0, "decoupled weight decay")
    momentum: float = setting(0.9, "SGD momentum")
    nesterov: bool = setting(False, "SGD: Nesterov momentum")
    muon_momentum: float = setting(0.95, "Muon's momentum (optimizer='muon': its matrices)")
    muon_nesterov: bool = setting(True, "Muon: Nesterov momentum")
    muon_ns_steps: int = setting(5, "Muon: Newton-Schulz iterations")
    muon_adjust_lr: str = setting("match_rms_adamw", "Muon's lr per matrix shape: match_rms_adamw (one lr "
                                  "for Muon and AdamW) or original (torch's default)")
    max_grad_norm: float | None = setting(None, "clip the global gradient norm to this; none = no clipping")
    step_copy: str = setting("auto", "where a sharded round proposes its step until every rank's new parameters "
                             "are known finite: whole = a spare copy of the shard's master and moments (12 "
                             "bytes per owned value with AdamW), installed as it is; piece = a few piece-sized "
                             "scratch slots, the step recomputed in place at install (the same bits; a commit "
                             "round runs the optimizer twice); auto = piece on CUDA, whole elsewhere and with "
                             "optimizer='muon' (its matrices reach past a piece)")
    optimizer_offload: str = setting("none", "where the optimizer's state lives and steps (zero1, dpu, "
                                     "acco; diloco, sparseloco and local_sgd: the inner state): none = on "
                                     "the compute device; cpu = the fp32 master and moments "
                                     "of the rank's shard in host memory (pinned with CUDA), the step run on "
                                     "the CPU, each piece's gradient copied to the host and its new values "
                                     "back (engine/runtime/offload.py; step_copy auto is then whole, in host "
                                     "memory)")

    RULES: ClassVar[dict[str, Rule]] = {
        "name": choice(tuple(OPTIMIZERS)),
        "lr": number(0, low_open=True),
        "betas": _betas,
        "eps": number(0, low_open=True),
        "weight_decay": number(0),
        "momentum": number(0, 1, high_open=True),
        "nesterov": boolean,
        "muon_momentum": number(0, 1, high_open=True),
        "muon_nesterov": boolean,
        "muon_ns_steps": integer(1),
        "muon_adjust_lr": choice(MUON_ADJUST_LR),
        "max_grad_norm": optional(number(0, low_open=True), "no clipping"),
        "step_copy": choice(STEP_COPIES),
        "optimizer_offload": choice(OPTIMIZER_OFFLOADS),
    }


@dataclass
class ScheduleConfig:
    """The learning rate over committed steps (its horizon is EngineConfig.max_steps)."""

    kind: str = setting("constant", "lr after warmup: constant, or a linear / cosine decay to "
                        "min_lr_ratio x lr at max_steps")  # flat keyword: lr_schedule
    warmup_steps: int = setting(0, "steps of linear lr warmup")
    min_lr_ratio: float = setting(0.0, "the decay's final lr as a fraction of lr")

    RULES: ClassVar[dict[str, Rule]] = {
        "kind": choice(SCHEDULES),
        "warmup_steps": integer(0),
        "min_lr_ratio": number(0, 1),
    }


@dataclass
class AccumulationConfig:
    """How many micro-batches a step and each of its rounds take."""

    mode: str = setting("fixed", "fixed = the batch you set, every step (global_micro_batches, or "
                        "micro_batches per worker and round); grow = keep accumulating while the "
                        "round in flight is still on the wire, so the batch grows with the link's "
                        "delay (at least micro_batches, at most max_micro_batches per round)")  # flat keyword: accumulation
    global_micro_batches: int | None = setting(
        None, "fixed: micro-batches per optimizer step, all workers and rounds together (the global "
        "batch is this times the micro-batch size; acco splits it over its estimate and commit "
        "rounds); none = micro_batches per worker and round")
    balance: str = setting("equal", "with global_micro_batches: how a round's micro-batches are shared "
                           "out: equal, or speed = in proportion to each worker's measured speed "
                           "(mixed GPUs; the step's batch stays the same)")
    micro_batches: int = setting(1, "micro-batches per worker and round (fixed without "
                                 "global_micro_batches), or the minimum per round (grow)")
    max_micro_batches: int | None = setting(None, "grow: the most micro-batches per round; none = no cap")
    # grow, CPU: raise the minimum per round so that the comm side's CPU per round stays
    # below this fraction of the round's compute (engine/batch/pacing.py)
    max_round_overhead: float = setting(0.15, "grow on CPU (acco, dpu): raise the minimum micro-batches "
                                        "per round until the comm side's CPU per round is at most this "
                                        "fraction of the round's compute (0 = off: rounds end when the "
                                        "one in flight is done)")

    RULES: ClassVar[dict[str, Rule]] = {
        "mode": choice(ACCUMULATION_MODES),
        "global_micro_batches": optional(integer(1), "micro_batches per worker and round"),
        "balance": choice(BALANCES),
        "micro_batches": integer(1),
        "max_micro_batches": optional(integer(1), "no cap"),
        "max_round_overhead": number(0, 1, high_open=True, note="0 turns it off"),
    }


@dataclass
class CommunicationConfig:
    """What goes on the wire and how (codecs: acco_loco/registry.py)."""

    codec: str = setting("none", "gradients on the wire: none (uncompressed), int<bits> (plain), "
                         "ef<bits> (classic error feedback), loco<bits> (LoCo error compensation), "
                         "sign1 (sign x RMS), fp16")
    param_codec: str = setting("auto", "parameter updates on the wire: auto (the compute dtype), "
                               "float32, bfloat16, or int8/int4 deltas")
    group_size: int = setting(128, "values per quantization group (a multiple of 8)")
    align: int = setting(128, "shards are multiples of this many values")
    loco_beta: float = setting(0.8, "LoCo: weight of the moving average of past errors")
    reset_period: int = setting(1024, "committed steps between error-feedback resets")
    error_storage: str = setting("int8", "how error feedback is stored: int8 (LoCo's 8-bit errors) or fp32")
    error_after_skip: str = setting("auto", "what a skipped step (a non-finite gradient or update) does to the "
                                    "error feedback: rollback = restore it from a copy taken at the step's "
                                    "start (a second error state in memory); reset = zero it, as the "
                                    "periodic reset does (no copy); auto = reset on CUDA, rollback elsewhere")
    scale_dtype: str = setting("float32", "dtype of the group scales on the wire")
    stochastic_rounding: bool = setting(False, "quantize with stochastic instead of nearest rounding")
    comm_chunks: int | str = setting("auto", "split each collective into this many async pieces: auto = on "
                                     "gloo up to 8 pieces of at least 64k values each (one gloo "
                                     "collective fills about half a link, 8 pieces 82-86 percent of it), on NCCL 1")

    RULES: ClassVar[dict[str, Rule]] = {
        "codec": _GradCodecChoice(tuple(GRAD_CODECS)),
        "param_codec": choice(PARAM_CODECS),
        "group_size": _group_size,
        "align": integer(1),
        "loco_beta": number(0, 1, high_open=True),
        "reset_period": integer(1),
        "error_storage": choice(ERROR_STORAGES),
        "error_after_skip": choice(ERROR_AFTER_SKIP),
        "scale_dtype": choice(SCALE_DTYPES),
        "stochastic_rounding": boolean,
        "comm_chunks": Check("'auto' or an integer >= 1", lambda v: v == "auto" or (is_int(v) and v >= 1)),
    }


@dataclass
class LayoutConfig:
    """Where the ranks sit and which exchange runs over them (engine/parallel/topology.py)."""

    topology: str = setting("auto", "auto = two-level when the run has at least 2 nodes of at least 2 ranks "
                            "(a full-precision reduce-scatter inside each node, then only the node's sum "
                            "crosses the network, 1/G per rank over its rail), flat otherwise; flat = one "
                            "exchange over all ranks; two_level = insist on it")
    ranks_per_node: int | None = setting(None, "ranks per node (G); none = the launcher's LOCAL_WORLD_SIZE "
                                         "(torchrun, accelerate launch), or 1 when it is not set")
    model_sharding: str = setting("none", "none = every rank holds the whole model; node = parameters, gradients "
                                  "and optimizer state sharded over the node's ranks with torch's FSDP2 (per "
                                  "transformer block), the engine's exchange across nodes on each rank's local "
                                  "shards (zero1, dpu, acco)")
    activation_checkpointing: bool = setting(False, "recompute each transformer block's activations in the "
                                             "backward pass instead of keeping them (torch.utils.checkpoint)")

    RULES: ClassVar[dict[str, Rule]] = {
        "topology": choice(TOPOLOGIES),
        "ranks_per_node": optional(integer(1), "the launcher's LOCAL_WORLD_SIZE"),
        "model_sharding": choice(MODEL_SHARDINGS),
        "activation_checkpointing": boolean,
    }


@dataclass
class RuntimeConfig:
    """Failure detection, checkpoints, progress and debugging."""

    timeout_s: float = setting(300.0, "seconds a silent peer may take before it is reported as lost")
    heartbeat_s: float = setting(1.0, "seconds between liveness heartbeats (at most timeout_s / 3)")
    checkpoint_dir: str | os.PathLike | None = setting(None, "where checkpoints go (to_dict stores a str)")
    checkpoint_every: int = setting(0, "committed steps between checkpoints (0 = never)")
    checkpoint_async: bool = setting(False, "write periodic checkpoints on a thread from a copy of the state "
                                     "(the compute side pauses for the copy only); each is finished, and "
                                     "'latest' moved to it, at the next save or at close")
    checkpoint_every_s: float | None = setting(None, "seconds between checkpoints (the first after the first "
                                               "step; the ranks agree on the step from rank 0's clock at "
                                               "each save); none = by steps only")
    progress: bool = setting(False, "a progress bar on rank 0")
    record_timeline: bool = setting(False, "per-round timestamps in engine.timeline")
    poison_freed_buffers: bool = setting(False, "debug: NaN-fill gradient buffers once released")
    keep_cpu_memory: bool = setting(True, "CPU: glibc keeps freed memory (engine/runtime/cpu_memory.py)")

    RULES: ClassVar[dict[str, Rule]] = {
        "timeout_s": number(0, low_open=True),
        "heartbeat_s": number(0, low_open=True),
        "checkpoint_dir": _checkpoint_dir,
        "checkpoint_every": integer(0),
        "checkpoint_every_s": optional(number(0, low_open=True), "by steps only"),
        "checkpoint_async": boolean,
        "progress": boolean,
        "record_timeline": boolean,
        "poison_freed_buffers": boolean,
        "keep_cpu_memory": boolean,
    }
