"""Translate a DeepSpeed config into this engine's settings.

    python -m engine.from_deepspeed ds_config.json [--world-size N]

prints the equivalent ``EngineConfig(...)``, the recipes/finetune.py flags that give the same
run, and every key it could not map with the reason. A file that cannot be read (missing, not
JSON, a value of the wrong type) is one line on stderr and exit status 2.

The keys and their meaning are DeepSpeed's configuration reference (docs/_pages/config-json.md
and deepspeed/runtime/zero/config.py, lr_schedules.py of deepspeedai/DeepSpeed). What maps:

- ``zero_optimization.stage`` 0/1/2 -> strategy zero1 (this engine's synchronous data parallelism
  always shards the optimizer state; its trajectory is plain data parallelism's); stage 3 ->
  ``model_sharding="node"`` where EngineConfig has that setting.
- optimizer Adam/AdamW (lr, betas, eps, weight_decay) -> adamw; OneBitAdam/ZeroOneAdam ->
  strategy onebit_adam, ``freeze_step`` (``var_freeze_step``) -> ``onebit_warmup_steps``.
- ``gradient_clipping`` -> ``max_grad_norm``; ``bf16`` -> ``compute_dtype="bfloat16"``.
- ``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` x world = ``train_batch_size``
  -> ``--micro-batch-size`` and ``global_micro_batches`` (micro-batches per step, every worker).
- schedulers WarmupLR / WarmupDecayLR / WarmupCosineLR -> warmup_steps and a constant / linear /
  cosine schedule over ``total_num_steps`` (= max_steps).
- ``zero_quantized_gradients`` -> codec int4 (ZeRO++'s 4-bit gradients), with
  ``zeropp_loco_param`` -> loco4 (``err_beta`` -> loco_beta, ``reset_T`` -> reset_period);
  ``zero_quantized_weights`` -> ``param_codec="int8"`` (ZeRO++'s 8-bit weights).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from .config import EngineConfig, describe_settings
from .strategies import strategy_class

AUTO = "auto"  # the HF Trainer integration fills these from TrainingArguments
# the recipe's own flags this translation may print (recipes/finetune.py RecipeSettings)
RECIPE_FLAGS = ("micro_batch_size",)
DS_ADAM = ("adam", "adamw")
DS_ONEBIT = ("onebitadam", "zerooneadam")
# keys that only tune DeepSpeed's own machinery: nothing in this engine corresponds to them
_MACHINERY = "tunes DeepSpeed's own buffers or kernels; the engine sizes its own (comm_chunks, align)"
_IGNORED_ZERO = {"overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
                 "allgather_partitions", "reduce_scatter", "round_robin_gradients", "sub_group_size",
                 "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
                 "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
                 "ignore_unused_parameters", "elastic_checkpoint", "memory_efficient_linear",
                 "log_trace_cache_warnings", "load_from_fp32_weights"}
_QUIET = {"steps_per_print": "logging cadence: the engine logs every committed step (engine.history)",
          "wall_clock_breakdown": "DeepSpeed's timers: the engine's are record_timeline",
          "zero_allow_untested_optimizer": "no such check here", "prescale_gradients": _MACHINERY,
          "gradient_predivide_factor": "fp16 overflow guard: the engine averages in fp32",
          "communication_data_type": "the wire format is the codec setting (codec, param_codec)"}


class DeepSpeedConfigError(ValueError):
    """A config this translation cannot read: the message is the one line the user sees."""


@dataclass
class Translation:
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig keywords
    recipe: dict[str, Any] = field(default_factory=dict)  # recipe-only flags (micro_batch_size)
    unmapped: list[tuple[str, str]] = field(default_factory=list)  # (key, why)

    def skip(self, key: str, why: str) -> None:
        self.unmapped.append((key, why))

    def config(self) -> EngineConfig:
        """The EngineConfig, checked as the engine checks it (its fields, then the strategy's rules)."""
        cfg = EngineConfig(**self.engine)
        strategy_class(cfg.strategy).check(cfg)
        return cfg


# ------------------------------------------------------------------------ typed reads
def _kind(value: Any, kind: str) -> bool:
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {"bool": bool, "dict": dict, "str": str}[kind])


def _get(section: dict, key: str, path: str, kind: str, *, auto: bool = False) -> Any:
    """section[key] if present (None if absent), refused unless of ``kind`` (or "auto" where allowed)."""
    if key not in section or section[key] is None:
        return None
    value = section[key]
    if auto and value == AUTO:
        return AUTO
    if not _kind(value, kind):
        also = ' or "auto"' if auto else ""
        raise DeepSpeedConfigError(f"{path}{key} must be {'an' if kind == 'int' else 'a'} {kind}{also}, "
                                   f"got {value!r}")
    return value


def _section(ds: dict, key: str) -> dict:
    value = _get(ds, key, "", "dict")
    return value if value is not None else {}


# ------------------------------------------------------------------------ the mappings
def translate(ds: Any, world_size: int | None = None) -> Translation:
    """The engine settings ``ds`` (a parsed DeepSpeed config) stands for; ``world_size`` (the
    number of GPUs it ran on) turns a per-GPU batch into the global one when the config lacks
    train_batch_size."""
    if not isinstance(ds, dict):
        raise DeepSpeedConfigError(f"a DeepSpeed config is a JSON object of settings, got {type(ds).__name__}")
    t = Translation()
    handled = {"zero_optimization", "optimizer", "scheduler", "gradient_clipping", "bf16", "fp16",
               "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    _zero(_section(ds, "zero_optimization"), t)
    onebit = _optimizer(_section(ds, "optimizer"), t)
    _precision(ds, t)
    _batch(ds, t, world_size)
    _scheduler(_section(ds, "scheduler"), t)
    clip = _get(ds, "gradient_clipping", "", "number", auto=True)
    if clip == AUTO:
        t.skip("gradient_clipping", "'auto' (the Trainer's max_grad_norm): pass --max-grad-norm")
    elif clip is not None and clip > 0:  # DeepSpeed: 0 turns clipping off
        t.engine["max_grad_norm"] = float(clip)
    if onebit and t.engine["codec"] != "none":
        t.skip("zero_optimization.zero_quantized_gradients", "1-bit Adam compresses its momentum itself and "
               "warms up on exact gradients: the gradient codec stays 'none'")
        t.engine["codec"] = "none"
        for name in ("loco_beta", "reset_period"):
            t.engine.pop(name, None)
    for key in sorted(set(ds) - handled):
        t.skip(key, _QUIET.get(key, "no counterpart in this engine"))
    return t


def _zero(zero: dict, t: Translation) -> None:
    path = "zero_optimization."
    stage = _get(zero, "stage", path, "int")
    if stage is not None and stage not in (0, 1, 2, 3):
        raise DeepSpeedConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    t.engine["strategy"] = "zero1"
    if stage == 3:
        if "model_sharding" in EngineConfig.field_names():
            t.engine["model_sharding"] = "node"
        else:
            t.skip("zero_optimization.stage=3", "parameter sharding needs EngineConfig's model_sharding "
                   "setting, which this version lacks: the run is ZeRO-1 (every worker holds the whole model)")
    # DeepSpeed sends full-precision gradients and parameters unless ZeRO++ says otherwise; said
    # explicitly, since recipes/finetune.py compresses by default
    t.engine["codec"], t.engine["param_codec"] = "none", "auto"
    quant_grads = _get(zero, "zero_quantized_gradients", path, "bool")
    loco = _get(zero, "zeropp_loco_param", path, "dict")
    if loco is not None and not quant_grads:
        t.skip("zero_optimization.zeropp_loco_param", "LoCo only acts on quantized gradients: "
               "zero_quantized_gradients is not true")
    elif quant_grads:
        t.engine["codec"] = "loco4" if loco is not None else "int4"
        for key, name in (("err_beta", "loco_beta"), ("reset_T", "reset_period")):
            value = _get(loco or {}, key, path + "zeropp_loco_param.", "number" if key == "err_beta" else "int")
            if value is not None:
                t.engine[name] = value
        for key in sorted(set(loco or {}) - {"err_beta", "reset_T"}):
            t.skip(f"{path}zeropp_loco_param.{key}", "no counterpart in the engine's LoCo")
    if _get(zero, "zero_quantized_weights", path, "bool"):
        t.engine["param_codec"] = "int8"
    if _get(zero, "zero_hpz_partition_size", path, "int") not in (None, 1):
        t.skip(f"{path}zero_hpz_partition_size", "ZeRO++'s secondary copy inside a node: the engine's "
               "topology='two_level' reduces inside each node first (set ranks_per_node)")
    for key in ("offload_optimizer", "offload_param"):
        if key in zero:
            t.skip(path + key, "the engine keeps the optimizer shard and the parameters on the device")
    known = {"stage", "zero_quantized_gradients", "zeropp_loco_param", "zero_quantized_weights",
             "zero_hpz_partition_size", "offload_optimizer", "offload_param"}
    for key in sorted(set(zero) - known):
        t.skip(path + key, _MACHINERY if key in _IGNORED_ZERO else "no counterpart in this engine")


def _optimizer(opt: dict, t: Translation) -> bool:
    """Maps the optimizer; True when it is a 1-bit one (strategy onebit_adam)."""
    if not opt:
        return False
    kind = _get(opt, "type", "optimizer.", "str")
    params = _get(opt, "params", "optimizer.", "dict") or {}
    name = (kind or "").lower()
    if name not in DS_ADAM + DS_ONEBIT:
        t.skip(f"optimizer.type={kind}", "the engine's optimizers are adamw, sgd and 1-bit Adam "
               "(strategy onebit_adam): choose one of them")
        return False
    path = "optimizer.params."
    lr = _get(params, "lr", path, "number", auto=True)
    if lr == AUTO:
        t.skip(path + "lr", "'auto' (the Trainer's learning_rate): pass --lr")
    elif lr is not None:
        t.engine["lr"] = lr
    betas = params.get("betas")
    if betas == AUTO:
        t.skip(path + "betas", "'auto' (the Trainer's adam_beta1/2): the engine's (0.9, 0.999) apply")
    elif betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2 and all(_kind(b, "number") for b in betas)):
            raise DeepSpeedConfigError(f"{path}betas must be a list of two numbers, got {betas!r}")
        t.engine["betas"] = tuple(betas)
    for key in ("eps", "weight_decay"):
        value = _get(params, key, path, "number", auto=True)
        if value == AUTO:
            t.skip(path + key, f"'auto' (the Trainer's {'adam_epsilon' if key == 'eps' else key}): "
                   f"pass --{key.replace('_', '-')}")
        elif value is not None:
            t.engine[key] = value
    mapped = {"lr", "betas", "eps", "weight_decay"}
    if name in DS_ADAM:
        w_mode = _get(params, "adam_w_mode", path, "bool")
        decay = t.engine.get("weight_decay", 0)
        if name == "adam" and w_mode is False and decay:
            t.skip(path + "adam_w_mode=false", "Adam with L2 weight decay: the engine's AdamW decays the "
                   "weights decoupled (mapped to adamw with the same weight_decay; not the same update)")
        mapped |= {"adam_w_mode", "torch_adam", "fused"} | ({"amsgrad"} if params.get("amsgrad") is False else set())
    else:
        t.engine["strategy"] = "onebit_adam"
        freeze_key = "freeze_step" if name == "onebitadam" else "var_freeze_step"
        freeze = _get(params, freeze_key, path, "int")
        if freeze is not None:
            if freeze < 1:
                raise DeepSpeedConfigError(f"{path}{freeze_key} must be a positive integer, got {freeze}")
            t.engine["onebit_warmup_steps"] = freeze
        mapped |= {freeze_key, "cuda_aware", "comm_backend_name"}
        if name == "zerooneadam":
            for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
                if key in params:
                    t.skip(path + key, "0/1 Adam's variance refreshes and local steps: the engine's 1-bit "
                           "Adam warms up with AdamW, freezes the variance once, and syncs every step")
            mapped |= {"var_update_scaler", "local_step_scaler", "local_step_clipper"}
        if "bias_correction" in params:
            mapped.add("bias_correction")
            if params["bias_correction"] is False:
                t.skip(path + "bias_correction=false", "the engine's AdamW always corrects the moments' bias")
    for key in sorted(set(params) - mapped):
        t.skip(path + key, "no counterpart in the engine's AdamW")
    return name in DS_ONEBIT


def _precision(ds: dict, t: Translation) -> None:
    for key in ("bf16", "fp16"):
        section = _section(ds, key)
        enabled = _get(section, "enabled", key + ".", "bool", auto=True)
        if enabled == AUTO:
            t.skip(f"{key}.enabled", f"'auto' (the Trainer's --{key}): pass --compute-dtype "
                   f"{'bfloat16' if key == 'bf16' else 'float32 or bfloat16'}")
        elif enabled and key == "bf16":
            t.engine["compute_dtype"] = "bfloat16"
        elif enabled:
            t.skip("fp16.enabled", "the engine computes in float32 or bfloat16 and has no loss scaling: "
                   "use compute_dtype='bfloat16' where the hardware has it, else float32 (the default here)")
        for sub in sorted(set(section) - {"enabled"}):
            if enabled:
                t.skip(f"{key}.{sub}", "no counterpart: the engine keeps fp32 master weights and moments")


def _batch(ds: dict, t: Translation, world_size: int | None) -> None:
    total = _get(ds, "train_batch_size", "", "int", auto=True)
    micro = _get(ds, "train_micro_batch_size_per_gpu", "", "int", auto=True)
    accum = _get(ds, "gradient_accumulation_steps", "", "int", auto=True)
    for key, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accum)):
        if value == AUTO:
            t.skip(key, "'auto' (the Trainer fills it from per_device_train_batch_size, "
                   "gradient_accumulation_steps and the world size): pass --micro-batch-size and "
                   "--global-micro-batches yourself")
        elif value is not None and value < 1:
            raise DeepSpeedConfigError(f"{key} must be a positive integer, got {value}")
    total, micro, accum = (None if v == AUTO else v for v in (total, micro, accum))
    if micro is None and total is not None and accum is not None and world_size:
        micro, rest = divmod(total, accum * world_size)
        if rest or micro < 1:
            raise DeepSpeedConfigError(f"train_batch_size {total} is not gradient_accumulation_steps "
                                       f"{accum} x world {world_size} x a micro-batch")
    if micro is None:
        return
    t.recipe["micro_batch_size"] = micro
    if total is not None:
        if total % micro:
            raise DeepSpeedConfigError(f"train_batch_size {total} is not a multiple of "
                                       f"train_micro_batch_size_per_gpu {micro}")
        if world_size and accum is not None and total != micro * accum * world_size:
            raise DeepSpeedConfigError(f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                                       f"gradient_accumulation_steps {accum} x world {world_size}")
        t.engine["global_micro_batches"] = total // micro
    elif world_size:
        t.engine["global_micro_batches"] = (accum or 1) * world_size
    else:  # per worker: the same global batch at any world size (one round per step)
        if (accum or 1) > 1:
            t.engine["micro_batches"] = accum
        t.skip("train_batch_size", "absent and no --world-size: the batch is set per worker "
               "(micro_batches = gradient_accumulation_steps); give --world-size N for global_micro_batches")


def _scheduler(sched: dict, t: Translation) -> None:
    if not sched:
        return
    kind = _get(sched, "type", "scheduler.", "str")
    params = _get(sched, "params", "scheduler.", "dict") or {}
    path = "scheduler.params."
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        t.skip(f"scheduler.type={kind}", "the engine's schedules are warmup + constant, linear or cosine "
               "decay (WarmupLR, WarmupDecayLR, WarmupCosineLR)")
        return
    warmup = _get(params, "warmup_num_steps", path, "int", auto=True)
    warmup = 1000 if warmup is None else warmup  # DeepSpeed's default
    if warmup == AUTO:
        t.skip(path + "warmup_num_steps", "'auto' (the Trainer's warmup steps): pass --warmup-steps")
    else:
        t.engine["warmup_steps"] = warmup
    total = _get(params, "total_num_steps", path, "int", auto=True)
    if total == AUTO:
        t.skip(path + "total_num_steps", "'auto' (the Trainer's max_steps): pass --max-steps")
    elif total is not None:
        t.engine["max_steps"] = total
    mapped = {"warmup_num_steps", "total_num_steps", "warmup_type", "last_batch_iteration"}
    if params.get("warmup_type", "log") != "linear":
        t.skip(path + "warmup_type", "DeepSpeed's default warmup is logarithmic; the engine's is linear "
               "(from lr / (warmup_steps + 1) to lr)")
    if kind == "WarmupCosineLR":
        t.engine["lr_schedule"] = "cosine"
        ratio = _get(params, "cos_min_ratio", path, "number")
        t.engine["min_lr_ratio"] = 0.0001 if ratio is None else ratio  # DeepSpeed's default
        mapped |= {"cos_min_ratio"}
        if _get(params, "warmup_min_ratio", path, "number"):
            t.skip(path + "warmup_min_ratio", "the engine's warmup starts at lr / (warmup_steps + 1)")
        mapped.add("warmup_min_ratio")
    else:
        t.engine["lr_schedule"] = "constant" if kind == "WarmupLR" else "linear"
        if kind == "WarmupDecayLR":
            t.engine["min_lr_ratio"] = 0.0
        peak = _get(params, "warmup_max_lr", path, "number", auto=True)
        if peak == AUTO:
            t.skip(path + "warmup_max_lr", "'auto' (the Trainer's learning_rate): pass --lr")
        elif peak is not None:
            t.engine["lr"] = peak  # the scheduler's peak overrides the optimizer's lr in DeepSpeed
        low = _get(params, "warmup_min_lr", path, "number", auto=True)
        if low not in (None, 0, AUTO):
            t.skip(path + "warmup_min_lr", "the engine's warmup starts at lr / (warmup_steps + 1)")
        mapped |= {"warmup_max_lr", "warmup_min_lr"}
    for key in sorted(set(params) - mapped):
        t.skip(path + key, f"not a parameter of {kind}")


# ------------------------------------------------------------------------ output
def recipe_flags(t: Translation) -> list[str]:
    """``--flag value`` pairs for recipes/finetune.py (its engine flags come from describe_settings)."""
    known = set(describe_settings()) | set(RECIPE_FLAGS)
    out = []
    for name, value in {**t.recipe, **t.engine}.items():
        if name not in known:
            raise AssertionError(f"{name} is no recipe flag")  # a mapping names a setting that is gone
        if name == "betas":
            continue  # the recipe sets betas itself (not a flag); the EngineConfig line carries them
        out.append(f"--{name.replace('_', '-')} {value}")
    return out


def report(t: Translation, source: str) -> str:
    cfg = t.config()  # checks the combination as the engine would
    args = ", ".join(f"{k}={v!r}" for k, v in t.engine.items())
    lines = [f"# {source}, as this engine's settings", "from engine import EngineConfig",
             f"cfg = EngineConfig({args})", "",
             "# recipes/finetune.py: the same run",
             "accelerate launch recipes/finetune.py " + " ".join(recipe_flags(t))]
    if "betas" in t.engine and tuple(t.engine["betas"]) != tuple(describe_settings()["betas"].default):
        lines.append(f"#   (betas={tuple(cfg.betas)} has no flag: the recipe uses the default; set it in code)")
    lines += ["", f"# not mapped ({len(t.unmapped)})" if t.unmapped else "# every key mapped"]
    lines += [f"#   {key}: {why}" for key, why in t.unmapped]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.from_deepspeed", description=__doc__.split("\n")[0])
    p.add_argument("config", help="a DeepSpeed config JSON file (ds_config.json)")
    p.add_argument("--world-size", type=int, default=None,
                   help="GPUs the config ran on: turns a per-GPU batch without train_batch_size into the global one")
    args = p.parse_args(argv)
    try:
        if args.world_size is not None and args.world_size < 1:
            raise DeepSpeedConfigError(f"--world-size must be at least 1, got {args.world_size}")
        try:
            with open(args.config, encoding="utf-8") as f:
                ds = json.load(f)
        except OSError as exc:
            raise DeepSpeedConfigError(f"cannot read it: {exc.strerror or exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DeepSpeedConfigError(f"not valid JSON: {exc}") from exc
        t = translate(ds, args.world_size)
        text = report(t, args.config)
    except (DeepSpeedConfigError, ValueError) as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
