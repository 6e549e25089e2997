"""EngineConfig checks the type and range of every field at construction (issue 9, item 2).

NaN fails every comparison and a bool is an int in Python, so a range check alone lets
``lr=inf``, ``eps=nan``, ``stochastic_rounding="no"`` or ``warmup_steps=2.5`` through; training
then skips every step or fails far from the config. Each bad value below must be refused with a
message that names the field, shows the value and says what is allowed.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

from acco_loco.optim import OptimizerSpec
from acco_loco.schedule import validate_schedule
from engine import EngineConfig

INF, NAN = math.inf, math.nan

# (kwargs, a fragment of the message, matched literally)
BAD_VALUES: list[tuple[dict, str]] = [
    # strategy and accumulation
    ({"strategy": "ddp"}, "unknown strategy 'ddp': choose one of"),
    ({"strategy": None}, "unknown strategy None"),
    ({"strategy": 1}, "unknown strategy 1"),
    ({"auto_goal": "fastest"}, "unknown auto_goal 'fastest': choose one of"),
    ({"auto_loss_bound_pct": -1}, "auto_loss_bound_pct must be a finite number >= 0, got -1"),
    ({"auto_results": ""}, "auto_results must be None (./docs/results where it exists) or a non-empty path"),
    ({"micro_batches": 0}, "micro_batches must be a positive integer, got 0"),
    ({"micro_batches": 1.5}, "micro_batches must be a positive integer, got 1.5"),
    ({"micro_batches": 2.0}, "micro_batches must be a positive integer, got 2.0"),
    ({"micro_batches": True}, "micro_batches must be a positive integer, got True"),
    ({"micro_batches": "2"}, "micro_batches must be a positive integer, got '2'"),
    ({"accumulation": "sometimes"}, "unknown accumulation 'sometimes'"),
    ({"accumulation": None}, "unknown accumulation None"),
    ({"max_micro_batches": 0}, "max_micro_batches must be None (no cap) or a positive integer, got 0"),
    ({"max_micro_batches": 2.5}, "max_micro_batches must be None (no cap) or a positive integer, got 2.5"),
    ({"max_micro_batches": True}, "max_micro_batches must be None (no cap) or a positive integer, got True"),
    ({"max_micro_batches": "8"}, "max_micro_batches must be None (no cap) or a positive integer, got '8'"),
    ({"micro_batches": 4, "max_micro_batches": 2}, "max_micro_batches (2) is below micro_batches (4)"),
    ({"accumulation": "adaptive"}, "unknown accumulation 'adaptive'"),
    ({"max_micro_batches": 2}, "max_micro_batches caps accumulation='grow'"),
    ({"global_micro_batches": 0}, "global_micro_batches must be None (micro_batches per worker and round) or a positive"),
    ({"global_micro_batches": 8, "accumulation": "grow"}, "global_micro_batches fixes the batch but accumulation='grow'"),
    ({"global_micro_batches": 8, "micro_batches": 2}, "set one of micro_batches (2, per worker and round)"),
    ({"balance": "speed"}, "balance='speed' shares out a global batch"),
    ({"balance": "fast"}, "unknown balance 'fast'"),
    ({"max_round_overhead": 1.0}, "max_round_overhead must be a finite number in [0, 1) (0 turns it off), got 1.0"),
    ({"max_round_overhead": -0.1}, "max_round_overhead must be a finite number in [0, 1)"),
    ({"max_round_overhead": NAN}, "max_round_overhead must be a finite number in [0, 1) (0 turns it off), got nan"),
    ({"max_round_overhead": INF}, "max_round_overhead must be a finite number in [0, 1) (0 turns it off), got inf"),
    ({"max_round_overhead": -INF}, "max_round_overhead must be a finite number in [0, 1) (0 turns it off), got -inf"),
    ({"max_round_overhead": False}, "max_round_overhead must be a finite number in [0, 1) (0 turns it off), got False"),
    ({"max_round_overhead": "0.1"}, "got '0.1'"),
    ({"max_steps": 0}, "max_steps must be a positive integer, got 0"),
    ({"max_steps": 10.0}, "max_steps must be a positive integer, got 10.0"),
    ({"max_steps": True}, "max_steps must be a positive integer, got True"),
    ({"max_steps": "1000"}, "max_steps must be a positive integer, got '1000'"),
    # optimizer
    ({"optimizer": "lamb"}, "unknown optimizer 'lamb': choose one of ('adamw', 'sgd', 'muon')"),
    ({"muon_momentum": 1.0}, "muon_momentum must be a finite number in [0, 1), got 1.0"),
    ({"muon_nesterov": 1}, "muon_nesterov must be True or False (a bool, not 0/1 or a string), got 1"),
    ({"muon_ns_steps": 0}, "muon_ns_steps must be a positive integer, got 0"),
    ({"muon_adjust_lr": "none"}, "unknown muon_adjust_lr 'none': choose one of ('match_rms_adamw', 'original')"),
    ({"step_copy": "half"}, "unknown step_copy 'half': choose one of ('auto', 'whole', 'piece')"),
    ({"step_copy": "piece", "optimizer": "muon", "strategy": "zero1"}, "step_copy='piece' with optimizer='muon'"),
    ({"optimizer_offload": "gpu"}, "unknown optimizer_offload 'gpu': choose one of ('none', 'cpu')"),
    ({"optimizer_offload": "cpu", "strategy": "onebit_adam"}, "optimizer_offload='cpu' with strategy 'onebit_adam'"),
    ({"optimizer": "AdamW"}, "unknown optimizer 'AdamW'"),
    ({"optimizer": None}, "unknown optimizer None"),
    ({"lr": 0}, "lr must be a finite number > 0, got 0"),
    ({"lr": -1e-3}, "lr must be a finite number > 0, got -0.001"),
    ({"lr": INF}, "lr must be a finite number > 0, got inf"),
    ({"lr": -INF}, "lr must be a finite number > 0, got -inf"),
    ({"lr": NAN}, "lr must be a finite number > 0, got nan"),
    ({"lr": 10**400}, "lr must be a finite number > 0, got 1000"),  # too large for a float
    ({"lr": True}, "lr must be a finite number > 0, got True"),
    ({"lr": "3e-4"}, "lr must be a finite number > 0, got '3e-4'"),
    ({"lr": None}, "lr must be a finite number > 0, got None"),
    ({"betas": (0.9, 1.0)}, "betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got (0.9, 1.0)"),
    ({"betas": (-0.1, 0.999)}, "betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got (-0.1, 0.999)"),
    ({"betas": (NAN, 0.999)}, "betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got (nan, 0.999)"),
    ({"betas": (0.9, INF)}, "betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got (0.9, inf)"),
    ({"betas": (-INF, 0.9)}, "betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got (-inf, 0.9)"),
    ({"betas": (0.9,)}, "betas must be a pair (beta1, beta2)"),
    ({"betas": (0.9, 0.99, 0.999)}, "betas must be a pair (beta1, beta2)"),
    ({"betas": "ab"}, "betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got 'ab'"),
    ({"betas": 0.9}, "betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got 0.9"),
    ({"betas": (False, 0.999)}, "got (False, 0.999)"),
    ({"betas": ("0.9", "0.999")}, "got ('0.9', '0.999')"),
    ({"betas": None}, "betas must be a pair (beta1, beta2) of finite numbers in [0, 1), got None"),
    ({"eps": 0}, "eps must be a finite number > 0, got 0"),
    ({"eps": -1e-8}, "eps must be a finite number > 0, got -1e-08"),
    ({"eps": NAN}, "eps must be a finite number > 0, got nan"),
    ({"eps": INF}, "eps must be a finite number > 0, got inf"),
    ({"eps": -INF}, "eps must be a finite number > 0, got -inf"),
    ({"eps": True}, "eps must be a finite number > 0, got True"),
    ({"eps": "1e-8"}, "eps must be a finite number > 0, got '1e-8'"),
    ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0, got -0.1"),
    ({"weight_decay": NAN}, "weight_decay must be a finite number >= 0, got nan"),
    ({"weight_decay": INF}, "weight_decay must be a finite number >= 0, got inf"),
    ({"weight_decay": -INF}, "weight_decay must be a finite number >= 0, got -inf"),
    ({"weight_decay": True}, "weight_decay must be a finite number >= 0, got True"),
    ({"weight_decay": "0.01"}, "weight_decay must be a finite number >= 0, got '0.01'"),
    ({"momentum": 1.0}, "momentum must be a finite number in [0, 1), got 1.0"),
    ({"momentum": -0.1}, "momentum must be a finite number in [0, 1), got -0.1"),
    ({"momentum": NAN}, "momentum must be a finite number in [0, 1), got nan"),
    ({"momentum": INF}, "momentum must be a finite number in [0, 1), got inf"),
    ({"momentum": -INF}, "momentum must be a finite number in [0, 1), got -inf"),
    ({"momentum": False}, "momentum must be a finite number in [0, 1), got False"),
    ({"nesterov": 1}, "nesterov must be True or False (a bool, not 0/1 or a string), got 1"),
    ({"nesterov": "yes"}, "nesterov must be True or False (a bool, not 0/1 or a string), got 'yes'"),
    ({"nesterov": None}, "nesterov must be True or False (a bool, not 0/1 or a string), got None"),
    ({"max_grad_norm": 0}, "max_grad_norm must be None (no clipping) or a finite number > 0, got 0"),
    ({"max_grad_norm": -1.0}, "max_grad_norm must be None (no clipping) or a finite number > 0, got -1.0"),
    ({"max_grad_norm": NAN}, "max_grad_norm must be None (no clipping) or a finite number > 0, got nan"),
    ({"max_grad_norm": INF}, "max_grad_norm must be None (no clipping) or a finite number > 0, got inf"),
    ({"max_grad_norm": -INF}, "max_grad_norm must be None (no clipping) or a finite number > 0, got -inf"),
    ({"max_grad_norm": True}, "max_grad_norm must be None (no clipping) or a finite number > 0, got True"),
    ({"max_grad_norm": "1.0"}, "max_grad_norm must be None (no clipping) or a finite number > 0, got '1.0'"),
    ({"lr_schedule": "step"}, "unknown lr_schedule 'step': choose one of ('constant', 'linear', 'cosine')"),
    ({"lr_schedule": None}, "unknown lr_schedule None"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0, got -1"),
    ({"warmup_steps": 2.5}, "warmup_steps must be an integer >= 0, got 2.5"),
    ({"warmup_steps": NAN}, "warmup_steps must be an integer >= 0, got nan"),
    ({"warmup_steps": True}, "warmup_steps must be an integer >= 0, got True"),
    ({"warmup_steps": "10"}, "warmup_steps must be an integer >= 0, got '10'"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio must be a finite number in [0, 1], got 1.5"),
    ({"min_lr_ratio": -0.1}, "min_lr_ratio must be a finite number in [0, 1], got -0.1"),
    ({"min_lr_ratio": NAN}, "min_lr_ratio must be a finite number in [0, 1], got nan"),
    ({"min_lr_ratio": INF}, "min_lr_ratio must be a finite number in [0, 1], got inf"),
    ({"min_lr_ratio": -INF}, "min_lr_ratio must be a finite number in [0, 1], got -inf"),
    ({"min_lr_ratio": True}, "min_lr_ratio must be a finite number in [0, 1], got True"),
    ({"min_lr_ratio": "0.1"}, "min_lr_ratio must be a finite number in [0, 1], got '0.1'"),
    # numerics and layout
    ({"compute_dtype": "float16"}, "unknown compute_dtype 'float16': choose one of ('auto', 'float32', 'bfloat16')"),
    ({"compute_dtype": None}, "unknown compute_dtype None"),
    ({"grad_dtype": "bfloat16"}, "unknown grad_dtype 'bfloat16': choose one of ('auto', 'float32', 'compute')"),
    ({"align": 0}, "align must be a positive integer, got 0"),
    ({"align": 128.0}, "align must be a positive integer, got 128.0"),
    ({"align": True}, "align must be a positive integer, got True"),
    ({"nan_policy": "ignore"}, "unknown nan_policy 'ignore': choose one of ('skip', 'stop')"),
    ({"nan_policy": False}, "unknown nan_policy False"),
    ({"seed": "abc"}, "seed must be an integer in [0, 2**32), got 'abc'"),
    ({"seed": -1}, "seed must be an integer in [0, 2**32), got -1"),
    ({"seed": 1.5}, "seed must be an integer in [0, 2**32), got 1.5"),
    ({"seed": True}, "seed must be an integer in [0, 2**32), got True"),
    ({"seed": 2**32}, "seed must be an integer in [0, 2**32), got 4294967296"),
    ({"seed": None}, "seed must be an integer in [0, 2**32), got None"),
    # low-bit communication
    ({"codec": "int3"}, "unknown codec 'int3'"),
    ({"codec": "sign4"}, "unknown codec 'sign4'"),
    ({"codec": 8}, "codec must be a codec name such as 'none', 'int8' or 'loco4', got 8"),
    ({"codec": None}, "codec must be a codec name such as 'none', 'int8' or 'loco4', got None"),
    ({"param_codec": "int2"}, "unknown param_codec 'int2': choose one of"),
    ({"param_codec": None}, "unknown param_codec None"),
    ({"group_size": 12}, "group_size must be a positive multiple of 8, got 12"),
    ({"group_size": 0}, "group_size must be a positive multiple of 8, got 0"),
    ({"group_size": -8}, "group_size must be a positive multiple of 8, got -8"),
    ({"group_size": 16.0}, "group_size must be a positive multiple of 8, got 16.0"),
    ({"group_size": "128"}, "group_size must be a positive multiple of 8, got '128'"),
    ({"loco_beta": 1.0}, "loco_beta must be a finite number in [0, 1), got 1.0"),
    ({"loco_beta": -0.1}, "loco_beta must be a finite number in [0, 1), got -0.1"),
    ({"loco_beta": NAN}, "loco_beta must be a finite number in [0, 1), got nan"),
    ({"loco_beta": INF}, "loco_beta must be a finite number in [0, 1), got inf"),
    ({"loco_beta": -INF}, "loco_beta must be a finite number in [0, 1), got -inf"),
    ({"loco_beta": True}, "loco_beta must be a finite number in [0, 1), got True"),
    ({"reset_period": 0}, "reset_period must be a positive integer, got 0"),
    ({"reset_period": 1024.0}, "reset_period must be a positive integer, got 1024.0"),
    ({"reset_period": True}, "reset_period must be a positive integer, got True"),
    ({"error_storage": "int4"}, "unknown error_storage 'int4': choose one of ('int8', 'fp32')"),
    ({"error_after_skip": "keep"}, "unknown error_after_skip 'keep': choose one of ('auto', 'rollback', 'reset')"),
    ({"scale_dtype": "float16"}, "unknown scale_dtype 'float16': choose one of ('float32', 'bfloat16')"),
    ({"scale_dtype": 1}, "unknown scale_dtype 1"),
    ({"stochastic_rounding": "no"}, "stochastic_rounding must be True or False (a bool, not 0/1 or a string), got 'no'"),
    ({"stochastic_rounding": 1}, "stochastic_rounding must be True or False (a bool, not 0/1 or a string), got 1"),
    ({"stochastic_rounding": 0}, "stochastic_rounding must be True or False (a bool, not 0/1 or a string), got 0"),
    ({"stochastic_rounding": None}, "stochastic_rounding must be True or False (a bool, not 0/1 or a string), got None"),
    # outer rounds (diloco, sparseloco)
    ({"inner_steps": 0}, "inner_steps must be a positive integer, got 0"),
    ({"inner_steps": 15.0}, "inner_steps must be a positive integer, got 15.0"),
    ({"outer_lr": 0}, "outer_lr must be a finite number > 0, got 0"),
    ({"outer_lr": NAN}, "outer_lr must be a finite number > 0, got nan"),
    ({"outer_momentum": 1.0}, "outer_momentum must be a finite number in [0, 1), got 1.0"),
    ({"outer_momentum": -0.5}, "outer_momentum must be a finite number in [0, 1), got -0.5"),
    ({"outer_momentum_kind": True}, "unknown outer_momentum_kind True: choose one of ('nesterov', 'heavy_ball')"),
    ({"pseudo_grad_dtype": "float16"}, "unknown pseudo_grad_dtype 'float16': choose one of ('float32', 'bfloat16')"),
    ({"topk_density": 0}, "topk_density must be a finite number in (0, 1], got 0"),
    ({"topk_density": 1.5}, "topk_density must be a finite number in (0, 1], got 1.5"),
    ({"topk_chunk": 1}, "topk_chunk must be an integer in [2, 65536], got 1"),
    ({"topk_chunk": 2**17}, "topk_chunk must be an integer in [2, 65536], got 131072"),
    ({"topk_value_bits": 3}, "topk_value_bits must be one of (1, 2, 4, 8), got 3"),
    ({"topk_value_bits": 2.0}, "topk_value_bits must be one of (1, 2, 4, 8), got 2.0"),
    ({"sparse_error_beta": 1.5}, "sparse_error_beta must be a finite number in [0, 1], got 1.5"),
    ({"sparse_error_beta": INF}, "sparse_error_beta must be a finite number in [0, 1], got inf"),
    ({"sparse_aggregate": "median"}, "unknown sparse_aggregate 'median': choose one of ('mean', 'contributors')"),
    ({"topk_layout": "tiles"}, "unknown topk_layout 'tiles': choose one of ('flat', 'tensor')"),
    ({"sparse_clip": True}, "unknown sparse_clip True: choose one of ('none', 'median')"),
    ({"sparse_error_scale": 0.7}, "unknown sparse_error_scale 0.7: choose one of ('raw', 'outer_lr')"),
    ({"outer_overlap": 1}, "outer_overlap must be True or False (a bool, not 0/1 or a string), got 1"),
    ({"outer_period_s": 0}, "outer_period_s must be None (every inner_steps) or a finite number > 0, got 0"),
    ({"outer_period_s": "30"}, "outer_period_s must be None (every inner_steps) or a finite number > 0, got '30'"),
    ({"outer_state_device": "gpu"}, "unknown outer_state_device 'gpu': choose one of ('device', 'cpu')"),
    # onebit_adam
    ({"onebit_warmup_steps": 0}, "onebit_warmup_steps must be None (the variance rule decides) or a positive integer, got 0"),
    ({"onebit_warmup_steps": 2.5}, "onebit_warmup_steps must be None (the variance rule decides) or a positive integer"),
    ({"onebit_window": 0}, "onebit_window must be a positive integer, got 0"),
    ({"onebit_tolerance": 0}, "onebit_tolerance must be a finite number > 0, got 0"),
    ({"onebit_tolerance": NAN}, "onebit_tolerance must be a finite number > 0, got nan"),
    ({"onebit_min_warmup": True}, "onebit_min_warmup must be a positive integer, got True"),
    ({"onebit_max_warmup_fraction": 0}, "onebit_max_warmup_fraction must be a finite number in (0, 1], got 0"),
    ({"onebit_max_warmup_fraction": 1.5}, "onebit_max_warmup_fraction must be a finite number in (0, 1], got 1.5"),
    # acco's delay corrections
    ({"delay_compensation": -1.0}, "delay_compensation must be a finite number >= 0, got -1.0"),
    ({"delay_compensation": NAN}, "delay_compensation must be a finite number >= 0, got nan"),
    ({"weight_prediction": "1"}, "weight_prediction must be a finite number >= 0, got '1'"),
    ({"sync_steps": -1}, "sync_steps must be an integer >= 0, got -1"),
    ({"sync_steps": 2.0}, "sync_steps must be an integer >= 0, got 2.0"),
    ({"estimate_clip": "whole"}, "unknown estimate_clip 'whole'"),
    # runtime
    ({"timeout_s": 0}, "timeout_s must be a finite number > 0, got 0"),
    ({"timeout_s": -1}, "timeout_s must be a finite number > 0, got -1"),
    ({"timeout_s": NAN}, "timeout_s must be a finite number > 0, got nan"),
    ({"timeout_s": INF}, "timeout_s must be a finite number > 0, got inf"),
    ({"timeout_s": -INF}, "timeout_s must be a finite number > 0, got -inf"),
    ({"timeout_s": True}, "timeout_s must be a finite number > 0, got True"),
    ({"timeout_s": "300"}, "timeout_s must be a finite number > 0, got '300'"),
    ({"heartbeat_s": 0}, "heartbeat_s must be a finite number > 0, got 0"),
    ({"heartbeat_s": NAN}, "heartbeat_s must be a finite number > 0, got nan"),
    ({"heartbeat_s": INF}, "heartbeat_s must be a finite number > 0, got inf"),
    ({"heartbeat_s": -INF}, "heartbeat_s must be a finite number > 0, got -inf"),
    ({"heartbeat_s": "1"}, "heartbeat_s must be a finite number > 0, got '1'"),
    ({"timeout_s": 2, "heartbeat_s": 1}, "heartbeat_s (1) must be at most a third of timeout_s (2)"),
    ({"comm_chunks": 0}, "comm_chunks must be 'auto' or an integer >= 1, got 0"),
    ({"comm_chunks": 2.0}, "comm_chunks must be 'auto' or an integer >= 1, got 2.0"),
    ({"comm_chunks": True}, "comm_chunks must be 'auto' or an integer >= 1, got True"),
    ({"comm_chunks": "8"}, "comm_chunks must be 'auto' or an integer >= 1, got '8'"),
    ({"topology": "ring"}, "unknown topology 'ring'"),
    ({"ranks_per_node": 0}, "ranks_per_node must be"),
    ({"model_sharding": "rows"}, "unknown model_sharding 'rows'"),
    ({"model_sharding": "node", "topology": "flat"}, "it needs topology='auto' or 'two_level', not 'flat'"),
    ({"activation_checkpointing": 1}, "activation_checkpointing must be True or False"),
    ({"checkpoint_dir": ""}, "checkpoint_dir must be None or a non-empty path (a str or os.PathLike), got ''"),
    ({"checkpoint_dir": 123}, "checkpoint_dir must be None or a non-empty path (a str or os.PathLike), got 123"),
    ({"checkpoint_dir": b"/tmp/run"}, "checkpoint_dir must be None or a non-empty path (a str or os.PathLike), got b'/tmp/run'"),
    ({"checkpoint_every": 5}, "checkpoint_every is set but checkpoint_dir is not"),
    ({"checkpoint_every": -1}, "checkpoint_every must be an integer >= 0, got -1"),
    ({"checkpoint_every": 2.5, "checkpoint_dir": "run"}, "checkpoint_every must be an integer >= 0, got 2.5"),
    ({"checkpoint_every": True, "checkpoint_dir": "run"}, "checkpoint_every must be an integer >= 0, got True"),
    ({"checkpoint_every": "5", "checkpoint_dir": "run"}, "checkpoint_every must be an integer >= 0, got '5'"),
    ({"checkpoint_async": 1}, "checkpoint_async must be True or False (a bool, not 0/1 or a string), got 1"),
    ({"checkpoint_every_s": 60}, "checkpoint_every_s is set but checkpoint_dir is not"),
    ({"checkpoint_every_s": 0, "checkpoint_dir": "run"},
     "checkpoint_every_s must be None (by steps only) or a finite number > 0, got 0"),
    ({"checkpoint_every_s": True, "checkpoint_dir": "run"},
     "checkpoint_every_s must be None (by steps only) or a finite number > 0, got True"),
    ({"progress": 1}, "progress must be True or False (a bool, not 0/1 or a string), got 1"),
    ({"progress": "false"}, "progress must be True or False (a bool, not 0/1 or a string), got 'false'"),
    ({"record_timeline": "yes"}, "record_timeline must be True or False (a bool, not 0/1 or a string), got 'yes'"),
    ({"record_timeline": 0}, "record_timeline must be True or False (a bool, not 0/1 or a string), got 0"),
    ({"poison_freed_buffers": 1}, "poison_freed_buffers must be True or False (a bool, not 0/1 or a string), got 1"),
    ({"keep_cpu_memory": 0}, "keep_cpu_memory must be True or False (a bool, not 0/1 or a string), got 0"),
    ({"keep_cpu_memory": "True"}, "keep_cpu_memory must be True or False (a bool, not 0/1 or a string), got 'True'"),
    ({"keep_cpu_memory": None}, "keep_cpu_memory must be True or False (a bool, not 0/1 or a string), got None"),
]


def _id(kwargs: dict) -> str:
    return ",".join(f"{k}={v!r}" for k, v in kwargs.items())


@pytest.mark.parametrize("kwargs, fragment", BAD_VALUES, ids=[_id(kw) for kw, _ in BAD_VALUES])
def test_bad_value_is_refused_at_construction(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", BAD_VALUES, ids=[_id(kw) for kw, _ in BAD_VALUES])
def test_bad_value_is_refused_by_from_dict(kwargs, fragment):
    # a corrupt engine.json: the same message (from_dict turns JSON lists back into tuples)
    d = {**EngineConfig().to_dict(), **{k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}}
    with pytest.raises(ValueError, match=re.escape(fragment)):
        EngineConfig.from_dict(d)


def test_every_field_has_a_bad_value():
    tested = {k for kwargs, _ in BAD_VALUES for k in kwargs}
    fields = set(EngineConfig.field_names())  # every setting by its flat name
    assert fields - tested == set(), "add a bad value for these fields to BAD_VALUES"
    assert len({_id(kw) for kw, _ in BAD_VALUES}) == len(BAD_VALUES), "a bad value is listed twice"


@pytest.mark.parametrize("kwargs", [
    {},
    {"lr": 1, "eps": 1, "weight_decay": 0, "momentum": 0, "min_lr_ratio": 1, "loco_beta": 0},  # ints for floats
    {"max_round_overhead": 0, "timeout_s": 30, "heartbeat_s": 10, "max_grad_norm": 1},
    {"betas": [0.9, 0.95]},  # a list of two is a pair too
    {"betas": (0.0, 0.0)},
    {"strategy": "zero1", "accumulation": "grow", "micro_batches": 4, "max_micro_batches": 4},
    {"strategy": "acco", "accumulation": "fixed", "global_micro_batches": 6, "balance": "speed"},
    {"strategy": "dpu", "optimizer": "sgd", "momentum": 0.5, "nesterov": True},
    {"lr_schedule": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1, "max_steps": 100},
    {"codec": "loco4", "param_codec": "int8", "group_size": 64, "scale_dtype": "bfloat16",
     "error_storage": "fp32", "stochastic_rounding": True, "seed": 2**32 - 1, "reset_period": 1},
    {"codec": "sign1", "compute_dtype": "bfloat16", "nan_policy": "stop", "align": 8, "comm_chunks": 4},
    {"checkpoint_dir": "run", "checkpoint_every": 2, "progress": True, "record_timeline": True,
     "poison_freed_buffers": True, "keep_cpu_memory": False},
    {"checkpoint_dir": pathlib.Path("run"), "checkpoint_every": 0},
], ids=_id)
def test_good_values_are_accepted(kwargs):
    cfg = EngineConfig(**kwargs)
    cfg.validate()
    json.dumps(cfg.to_dict())  # what a checkpoint writes
    for k, v in kwargs.items():
        assert getattr(cfg, k) == v  # accepted as given: no default changes, no silent coercion


def test_from_dict_turns_json_lists_into_betas():
    cfg = EngineConfig.from_dict(json.loads('{"betas": [0.9, 0.95], "lr": 1}'))
    assert cfg.betas == (0.9, 0.95) and cfg.lr == 1
    assert cfg.optimizer_spec().betas == (0.9, 0.95)


def test_from_dict_round_trips_to_dict():
    cfg = EngineConfig(strategy="dpu", optimizer="sgd", lr=0.1, betas=(0.8, 0.9), momentum=0.5,
                       nesterov=True, max_grad_norm=2.0, lr_schedule="linear", warmup_steps=3,
                       min_lr_ratio=0.25, codec="ef4", param_codec="int4", group_size=32, seed=7,
                       checkpoint_dir="runs/a", checkpoint_every=5, accumulation="grow",
                       max_micro_batches=3)
    assert EngineConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert EngineConfig.from_dict(EngineConfig().to_dict()) == EngineConfig()
    as_path = EngineConfig(checkpoint_dir=pathlib.Path("runs") / "a", checkpoint_every=5)
    assert EngineConfig.from_dict(json.loads(json.dumps(as_path.to_dict()))).checkpoint_dir == "runs/a"


def test_from_dict_refuses_what_is_not_a_config():
    with pytest.raises(ValueError, match="unknown EngineConfig fields \\['learning_rate'\\]"):
        EngineConfig.from_dict({"learning_rate": 1e-3})
    with pytest.raises(ValueError, match="needs a dict of fields, got list"):
        EngineConfig.from_dict([["lr", 1e-3]])


@pytest.mark.parametrize("field, value, fragment", [
    ("lr", NAN, "lr must be a finite number > 0, got nan"),
    ("eps", INF, "eps must be a finite number > 0, got inf"),
    ("betas", (0.9, NAN), "betas must be a pair"),
    ("stochastic_rounding", "no", "stochastic_rounding must be True or False"),
    ("warmup_steps", 2.5, "warmup_steps must be an integer >= 0, got 2.5"),
    ("codec", "int3", "unknown codec 'int3'"),
    ("heartbeat_s", 200.0, "heartbeat_s (200.0) must be at most a third of timeout_s"),
    ("max_micro_batches", 0, "max_micro_batches must be None (no cap) or a positive integer, got 0"),
])
def test_assignment_after_construction_is_caught_by_validate(field, value, fragment):
    cfg = EngineConfig()
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        cfg.validate()
    setattr(cfg, field, getattr(EngineConfig(), field))
    cfg.validate()


def test_math_layer_refuses_non_finite_values_itself():
    # acco_loco is usable without EngineConfig: its own checks must not let NaN through
    for kwargs, fragment in [({"eps": NAN}, "eps must be a finite number > 0"),
                             ({"weight_decay": NAN}, "weight_decay must be a finite number >= 0"),
                             ({"momentum": NAN}, "momentum must be a finite number in [0, 1)"),
                             ({"betas": (0.9, NAN)}, "betas must be a pair"),
                             ({"nesterov": "no"}, "nesterov must be True or False")]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            OptimizerSpec(**kwargs)
    with pytest.raises(ValueError, match=re.escape("min_lr_ratio must be a finite number in [0, 1], got nan")):
        validate_schedule("cosine", 0, NAN)
    with pytest.raises(ValueError, match=re.escape("warmup_steps must be an integer >= 0, got 2.5")):
        validate_schedule("cosine", 2.5, 0.0)


def test_sections_flat_keywords_and_old_flat_dicts_agree():
    from engine.config import CommunicationConfig, OptimizerConfig

    nested = EngineConfig(strategy="zero1", optim=OptimizerConfig(name="sgd", lr=0.1),
                          comm={"codec": "loco4", "param_codec": "int8"})
    flat = EngineConfig(strategy="zero1", optimizer="sgd", lr=0.1, codec="loco4", param_codec="int8")
    assert nested == flat and nested.optim.lr == nested.lr == 0.1 and nested.comm.codec == "loco4"
    old_checkpoint = {**{k: getattr(flat, k) for k in EngineConfig.field_names()}, "betas": [0.9, 0.999]}
    assert EngineConfig.from_dict(old_checkpoint) == flat  # engine.json of an earlier release
    # a flat keyword refines the section it belongs to; sections are never shared
    section = CommunicationConfig(codec="int4")
    a = EngineConfig(comm=section, group_size=64)
    assert (a.codec, a.group_size, section.group_size) == ("int4", 64, 128)
    a.optim.lr = float("nan")
    with pytest.raises(ValueError, match="lr must be a finite number"):
        a.validate()
    with pytest.raises(ValueError, match=r"unknown OptimizerConfig fields \['learning_rate'\]"):
        EngineConfig(optim={"learning_rate": 1e-3})
    with pytest.raises(ValueError, match=r"optim must be OptimizerConfig\(...\) or a dict"):
        EngineConfig(optim=3)
