"""recipes/finetune.py with --model-sharding node, end to end: 4 CPU processes as 2 nodes x 2
ranks (two `accelerate launch` node agents on one rendezvous, as on two machines), a tiny GPT-2
with its lower blocks frozen (sharded too), acco in fp32, activation checkpointing, a held-out
evaluation split unevenly over the ranks (3 batches over 4 ranks: rank 3 has none and must still
run its node's forwards), a checkpoint and a --resume, and the plain-model export. Against the
same run unsharded (the two-level exchange): the same train losses, held-out losses and
exported weights, within float32 summation order. (fp32 on the wire: a codec's groups of
values fall differently on the local shards than on the unsharded node slice, so with loco4 the
two runs differ by quantization noise, O(lr) in single Adam steps; the codecs under node sharding
are checked in tests/engine/test_model_sharding.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lm.data import ByteTokenizer
from lm.models import tiny_gpt2
from tests.recipes.test_recipe_smoke import CPU_2PROC, RECIPE, REPO, _free_port
from tests.texts import text_folder

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo launch via torchrun")


def _launch_2x2(args: list[str], timeout: int = 240) -> str:
    """Both node agents of a 2 x 2 run; returns their output; fails the test on a non-zero exit."""
    port = str(_free_port())
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_2PROC),
         "--num_machines", "2", "--num_processes", "4", "--machine_rank", str(node),
         "--main_process_ip", "127.0.0.1", "--main_process_port", port, str(RECIPE), *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in range(2)]
    try:
        outputs = [a.communicate(timeout=timeout)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    return outputs[0] + outputs[1]


def _rows(out: Path, kind: str) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {(r["step"], r.get("tag")): r for r in rows if r["kind"] == kind}


def _by_step(out: Path) -> dict[int, list[float]]:
    losses: dict[int, list[float]] = {}
    for (step, _), row in _rows(out, "eval").items():
        losses.setdefault(step, []).append(row["eval_loss"])
    return losses


def test_node_sharded_recipe_matches_the_unsharded_run(tmp_path):
    data = text_folder(tmp_path / "text")
    common = ["--model", "tiny-gpt2", "--dataset", str(data), "--seq-len", "32", "--micro-batch-size", "2",
              "--train-layers", "2", "--eval-batches", "3", "--eval-every", "2", "--checkpoint-every", "2",
              "--strategy", "acco", "--codec", "none", "--param-codec", "float32", "--compute-dtype", "float32",
              "--timeout-s", "60"]
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    _launch_2x2(common + ["--max-steps", "4", "--output-dir", str(plain)])
    # half the run, then a --resume from its checkpoint: the resume is part of what must match
    node = ["--model-sharding", "node", "--activation-checkpointing"]
    _launch_2x2(common + ["--max-steps", "2", *node, "--output-dir", str(sharded)])
    log = _launch_2x2(common + ["--max-steps", "4", *node, "--output-dir", str(sharded),
                                "--resume"])
    assert "resumed at step 2" in log

    train_p, train_s = _rows(plain, "train"), _rows(sharded, "train")
    assert sorted(train_s) == sorted(train_p) == [(s, None) for s in range(1, 5)]
    for key, row in train_p.items():
        assert train_s[key]["loss"] == pytest.approx(row["loss"], rel=1e-6), key
        assert train_s[key]["grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-5), key
        assert train_s[key]["samples"] == row["samples"], key
    evals_p, evals_s = _by_step(plain), _by_step(sharded)
    # plain: before (step 0), eval (2), after (4); sharded: before (0), after (2) and, resumed,
    # before (2), after (4): every evaluation at one step must agree
    assert sorted(evals_p) == sorted(evals_s) == [0, 2, 4], (evals_p, evals_s)
    for step, losses in evals_p.items():
        assert evals_s[step] == pytest.approx(losses[:1] * len(evals_s[step]), rel=1e-6), step
    assert evals_p[4][0] < evals_p[0][0] - 0.1  # it trained

    from safetensors.torch import load_file

    exported_p = load_file(plain / "model" / "model.safetensors")
    exported_s = load_file(sharded / "model" / "model.safetensors")
    assert sorted(exported_s) == sorted(exported_p)
    for name, value in exported_p.items():
        assert exported_s[name].shape == value.shape, name
        torch.testing.assert_close(exported_s[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the trained blocks moved away from the initial model (seed 0), the frozen ones did not
    initial = tiny_gpt2(vocab_size=len(ByteTokenizer()), n_layer=4, n_embd=128, n_head=4, n_positions=256,
                        seed=0).state_dict()
    moved = {n for n, v in exported_s.items() if not torch.equal(v, initial[n])}
    assert moved and all(n.startswith(("transformer.h.2.", "transformer.h.3.", "transformer.ln_f.")) for n in moved)
    config = json.loads((sharded / "model" / "config.json").read_text())
    assert config["architectures"] == json.loads((plain / "model" / "config.json").read_text())["architectures"]
