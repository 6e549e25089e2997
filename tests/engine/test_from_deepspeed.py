"""python -m engine.from_deepspeed: DeepSpeed configs of each kind to EngineConfig and the recipe's
flags, and malformed configs to one line and a non-zero exit."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from acco_loco.schedule import lr_at
from engine import EngineConfig
from engine.from_deepspeed import DeepSpeedConfigError, main, recipe_flags, translate
from recipes.finetune import build_parser

ZERO2_ADAMW = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                      "warmup_num_steps": 50, "total_num_steps": 500,
                                                      "warmup_type": "linear"}},
    "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
}


def _unmapped(t) -> dict[str, str]:
    return dict(t.unmapped)


def _run(tmp_path, ds, *extra, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    rc = main([str(path), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_zero2_adamw_maps_every_setting_and_the_flags_parse_to_the_same_config():
    t = translate(ZERO2_ADAMW)
    assert t.engine == {"strategy": "zero1", "codec": "none", "param_codec": "auto", "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1,
                        "compute_dtype": "bfloat16", "global_micro_batches": 16, "warmup_steps": 50,
                        "max_steps": 500, "lr_schedule": "linear", "min_lr_ratio": 0.0, "max_grad_norm": 1.0}
    assert t.recipe == {"micro_batch_size": 4}
    # the two DeepSpeed buffer knobs are listed with why; nothing else is
    assert set(_unmapped(t)) == {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients"}
    cfg = t.config()
    assert cfg.global_micro_batches * t.recipe["micro_batch_size"] == ZERO2_ADAMW["train_batch_size"]
    # every printed flag is one of recipes/finetune.py's, and parses back to the same values (the
    # uncompressed codecs included: the recipe's own defaults compress)
    args = vars(build_parser().parse_args(shlex.split(" ".join(recipe_flags(t)))))
    for name, value in {**t.engine, **t.recipe}.items():
        if name != "betas":  # not a recipe flag: the report says so
            assert args[name] == value, name
    # WarmupDecayLR after its linear warmup: max_lr x (total - step) / (total - warmup)
    for step in (50, 200, 499):
        assert lr_at(step, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio) == \
            pytest.approx(3e-4 * (500 - step) / 450)


def test_batch_from_micro_accumulation_and_world(tmp_path, capsys):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    assert translate(ds, world_size=4).engine["global_micro_batches"] == 12
    no_world = translate(ds)  # per worker: the same global batch at any world size
    assert no_world.engine["micro_batches"] == 3 and "global_micro_batches" not in no_world.engine
    assert "train_batch_size" in _unmapped(no_world)
    # train_batch_size and accumulation give the micro-batch at a known world size
    t = translate({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world_size=4)
    assert t.recipe["micro_batch_size"] == 4 and t.engine["global_micro_batches"] == 8
    rc, out, err = _run(tmp_path, ds, "--world-size", "4", capsys=capsys)
    assert rc == 0 and "--global-micro-batches 12" in out and "--micro-batch-size 2" in out and err == ""


@pytest.mark.parametrize("kind,freeze_key", [("OneBitAdam", "freeze_step"), ("ZeroOneAdam", "var_freeze_step")])
def test_onebit_optimizers_map_to_onebit_adam_with_their_warmup(kind, freeze_key):
    ds = {"optimizer": {"type": kind, "params": {"lr": 1e-3, freeze_key: 400, "cuda_aware": False,
                                                 "comm_backend_name": "nccl", "var_update_scaler": 16}},
          "zero_optimization": {"stage": 1, "zero_quantized_gradients": True}}
    t = translate(ds)
    assert t.engine["strategy"] == "onebit_adam" and t.engine["onebit_warmup_steps"] == 400
    assert t.engine["lr"] == 1e-3 and t.engine["codec"] == "none"  # 1-bit Adam needs exact warmup gradients
    why = _unmapped(t)
    assert "zero_optimization.zero_quantized_gradients" in why
    assert ("0/1 Adam" in why["optimizer.params.var_update_scaler"]) == (kind == "ZeroOneAdam")
    assert "optimizer.params.cuda_aware" not in why  # the engine picks its backend itself
    assert t.config().onebit_warmup_steps == 400


def test_zeropp_loco_and_quantized_weights_map_to_the_codecs():
    loco = translate({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True,
                                            "zero_quantized_weights": True,
                                            "zeropp_loco_param": {"err_beta": 0.9, "reset_T": 512}}})
    assert {k: loco.engine[k] for k in ("codec", "loco_beta", "reset_period", "param_codec")} == \
        {"codec": "loco4", "loco_beta": 0.9, "reset_period": 512, "param_codec": "int8"}
    assert loco.unmapped == []
    plain = translate({"zero_optimization": {"zero_quantized_gradients": True}})
    assert plain.engine["codec"] == "int4" and "loco_beta" not in plain.engine
    orphan = translate({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.9}}})
    assert orphan.engine["codec"] == "none" and "zero_optimization.zeropp_loco_param" in _unmapped(orphan)


@pytest.mark.parametrize("kind,schedule,ratio", [("WarmupLR", "constant", None), ("WarmupDecayLR", "linear", 0.0),
                                                  ("WarmupCosineLR", "cosine", 0.05)])
def test_schedulers(kind, schedule, ratio):
    params = {"warmup_num_steps": 20, "warmup_type": "log", "total_num_steps": 300, "warmup_min_lr": 1e-6}
    if kind == "WarmupCosineLR":
        params = {"warmup_num_steps": 20, "total_num_steps": 300, "cos_min_ratio": 0.05, "warmup_type": "linear"}
    t = translate({"optimizer": {"type": "Adam", "params": {"lr": 5e-4}}, "scheduler": {"type": kind, "params": params}})
    assert t.engine["lr_schedule"] == schedule and t.engine["warmup_steps"] == 20
    assert t.engine.get("min_lr_ratio") == ratio
    assert ("max_steps" in t.engine) == (kind != "WarmupLR" or "total_num_steps" in params)
    why = _unmapped(t)
    assert ("scheduler.params.warmup_type" in why) == (params["warmup_type"] == "log")  # log warmup: not ours
    if kind == "WarmupLR":
        assert "scheduler.params.total_num_steps" not in why or t.engine["max_steps"] == 300
    t.config()
    other = translate({"scheduler": {"type": "OneCycle", "params": {}}})
    assert "scheduler.type=OneCycle" in _unmapped(other)


def test_stage3_maps_to_model_sharding_where_the_engine_has_it():
    t = translate({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    why = _unmapped(t)
    assert "zero_optimization.offload_param" in why
    if "model_sharding" in EngineConfig.field_names():
        assert t.engine["model_sharding"] == "node" and t.config().model_sharding == "node"
    else:
        assert "model_sharding" in why["zero_optimization.stage=3"] and "model_sharding" not in t.engine


def test_hf_trainer_auto_values_are_listed_not_guessed(tmp_path, capsys):
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 2}}
    t = translate(ds)
    assert t.engine == {"strategy": "zero1", "codec": "none", "param_codec": "auto", "lr_schedule": "linear",
                        "min_lr_ratio": 0.0}
    why = _unmapped(t)
    for key in ("train_batch_size", "gradient_clipping", "bf16.enabled", "optimizer.params.lr",
                "optimizer.params.betas", "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps"):
        assert "'auto'" in why[key], key
    rc, out, _ = _run(tmp_path, ds, capsys=capsys)
    assert rc == 0 and "cfg = EngineConfig(strategy='zero1'" in out and "optimizer.params.lr: 'auto'" in out


def test_fp16_unknown_optimizer_and_unknown_keys_are_listed_with_why():
    t = translate({"fp16": {"enabled": True, "loss_scale": 0}, "optimizer": {"type": "Lamb", "params": {}},
                   "wall_clock_breakdown": False, "flops_profiler": {"enabled": False}})
    why = _unmapped(t)
    assert "compute_dtype" not in t.engine and "loss scaling" in why["fp16.enabled"]
    assert "fp16.loss_scale" in why and "optimizer.type=Lamb" in why
    assert "wall_clock_breakdown" in why and why["flops_profiler"] == "no counterpart in this engine"


@pytest.mark.parametrize("content,expect", [
    (None, "cannot read it"),
    ("{\"optimizer\": ", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage must be an int"),
    ({"zero_optimization": {"stage": 4}}, "0, 1, 2 or 3"),
    ({"gradient_clipping": "high"}, "gradient_clipping must be a number"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "betas must be a list of two numbers"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1.0}}}, "lr"),
    ({"optimizer": "adam"}, "optimizer must be a dict"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "not a multiple"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled must be a bool"),
])
def test_malformed_configs_are_one_line_and_exit_2(tmp_path, capsys, content, expect):
    path = tmp_path / "ds_config.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    rc = main([str(path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(str(path)) and expect in err, err


def test_inconsistent_batch_and_world_are_refused():
    with pytest.raises(DeepSpeedConfigError, match="!= train_micro_batch_size_per_gpu"):
        translate({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
                  world_size=2)


def test_command_line_module(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO2_ADAMW))
    done = subprocess.run([sys.executable, "-m", "engine.from_deepspeed", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--strategy zero1" in done.stdout and "# not mapped (2)" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "engine.from_deepspeed", str(tmp_path / "missing.json")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
