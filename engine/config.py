"""EngineConfig: every knob of the engine, typed, with its default in code."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from acco_loco.acco import PLANS
from acco_loco.optim import OptimizerSpec
from acco_loco.schedule import validate_schedule

ACCUMULATION_MODES = ("adaptive", "fixed")
NAN_POLICIES = ("skip", "stop")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")

# Fields that decide the trajectory's structure: a checkpoint refuses to resume under others.
STRUCTURAL_FIELDS = ("strategy", "optimizer", "compute_dtype", "align", "codec", "param_codec",
                     "group_size", "error_storage", "scale_dtype")
ERROR_STORAGES = ("int8", "fp32")
SCALE_DTYPES = ("float32", "bfloat16")


@dataclass
class EngineConfig:
    # strategy and accumulation
    strategy: str = "acco"  # zero1 | dpu | acco
    micro_batches: int = 1  # per round ("fixed") or the minimum per round ("adaptive")
    accumulation: str = "adaptive"  # adaptive | fixed
    max_micro_batches: int | None = None  # adaptive: cap per round (keeps the batch small)
    # adaptive, CPU: raise the minimum per round so that the comm side's CPU per round stays
    # below this fraction of the round's compute (engine/pacing.py); 0 = off
    max_round_overhead: float = 0.15
    max_steps: int = 1000  # committed optimizer steps

    # optimizer (one flat fp32 shard per worker)
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    max_grad_norm: float | None = None  # global-norm clipping; None = off
    lr_schedule: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    # numerics and layout
    compute_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16
    align: int = 128  # shards are multiples of this many values (codec group size)
    nan_policy: str = "skip"  # skip the step, or stop with an error
    seed: int = 0

    # low-bit communication (LoCo): see README "Codecs"
    codec: str = "none"  # gradients: none | int8/4/2 | ef8/4/2/1 | loco8/4/2/1 | sign1
    param_codec: str = "auto"  # params: auto (compute dtype) | float32 | bfloat16 | int8 | int4 (deltas)
    group_size: int = 128  # values per quantization group (a multiple of 8)
    loco_beta: float = 0.8  # LoCo moving average of past errors
    reset_period: int = 1024  # committed steps between error resets
    error_storage: str = "int8"  # int8 (LoCo's 8-bit errors) | fp32
    scale_dtype: str = "float32"  # group scales on the wire: float32 | bfloat16
    stochastic_rounding: bool = False

    # runtime
    timeout_s: float = 300.0  # a peer silent this long is reported as lost
    heartbeat_s: float = 1.0
    comm_chunks: int = 1  # split each collective into this many async pieces (gloo speed)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # committed steps between checkpoints; 0 = never
    progress: bool = False  # a progress bar on rank 0
    record_timeline: bool = False  # per-round timestamps in engine.timeline
    poison_freed_buffers: bool = False  # debug: NaN-fill gradient buffers once released
    keep_cpu_memory: bool = True  # CPU: glibc keeps freed memory (engine/cpu_memory.py)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.strategy not in PLANS:
            raise ValueError(f"unknown strategy {self.strategy!r}: choose one of {sorted(PLANS)}")
        if self.accumulation not in ACCUMULATION_MODES:
            raise ValueError(f"unknown accumulation {self.accumulation!r}: choose one of {ACCUMULATION_MODES}")
        _positive_int("micro_batches", self.micro_batches)
        _positive_int("max_steps", self.max_steps)
        _positive_int("align", self.align)
        _positive_int("comm_chunks", self.comm_chunks)
        if self.max_micro_batches is not None:
            _positive_int("max_micro_batches", self.max_micro_batches)
            if self.max_micro_batches < self.micro_batches:
                raise ValueError(f"max_micro_batches ({self.max_micro_batches}) is below micro_batches "
                                 f"({self.micro_batches}): raise it or lower micro_batches")
        if isinstance(self.max_round_overhead, bool) or not isinstance(self.max_round_overhead, (int, float)) \
                or not 0 <= self.max_round_overhead < 1:
            raise ValueError(f"max_round_overhead must be a fraction in [0, 1) (0 turns it off), "
                             f"got {self.max_round_overhead!r}")
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(f"unknown nan_policy {self.nan_policy!r}: choose one of {NAN_POLICIES}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"unknown compute_dtype {self.compute_dtype!r}: choose one of {COMPUTE_DTYPES}")
        if not self.timeout_s > 0 or not self.heartbeat_s > 0:
            raise ValueError("timeout_s and heartbeat_s must be positive")
        if self.heartbeat_s * 3 > self.timeout_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be at most a third of timeout_s "
                             f"({self.timeout_s}) so that a lost peer is detected in time")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every is set but checkpoint_dir is not: give a directory")
        from .compressed import PARAM_CODECS, parse_grad_codec

        parse_grad_codec(self.codec)
        if self.param_codec not in PARAM_CODECS:
            raise ValueError(f"unknown param_codec {self.param_codec!r}: choose one of {PARAM_CODECS}")
        _positive_int("group_size", self.group_size)
        if self.group_size % 8:
            raise ValueError(f"group_size must be a multiple of 8, got {self.group_size}")
        if not 0.0 <= self.loco_beta < 1.0:
            raise ValueError(f"loco_beta must lie in [0, 1), got {self.loco_beta}")
        _positive_int("reset_period", self.reset_period)
        if self.error_storage not in ERROR_STORAGES:
            raise ValueError(f"unknown error_storage {self.error_storage!r}: choose one of {ERROR_STORAGES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"unknown scale_dtype {self.scale_dtype!r}: choose one of {SCALE_DTYPES}")
        validate_schedule(self.lr_schedule, self.warmup_steps, self.min_lr_ratio)
        self.optimizer_spec()  # validates the optimizer fields

    def optimizer_spec(self) -> OptimizerSpec:
        return OptimizerSpec(name=self.optimizer, betas=tuple(self.betas), eps=self.eps,
                             weight_decay=self.weight_decay, momentum=self.momentum,
                             nesterov=self.nesterov)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown EngineConfig fields {sorted(unknown)}")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
