"""The quick start's strategy="auto" takes what ``python -m engine.plan`` recommends for the link
and compute its probe measured (issue 44): the recipe's own engine config at 2 workers, through
engine/auto.py's ``choose_strategy`` with the probe's figures given instead of measured, against the
planner's command line fed the same figures in the probe's units (one synthetic sample of 512
tokens per micro-batch, B = the micro-batches per step). No processes, no shaped link."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.plan_validate import RESULTS
from engine.auto import choose_strategy
from engine.plan import main as plan_main
from engine.planner import probe
from recipes import finetune

# the quick start's model: SmolLM2-135M with its top 4 blocks and final norm trained
# (benchmarks/plan_validate.py: 4 x 3,540,096 + 576 of 134,515,008)
SMOLLM2_PARAMS, TRAINED = 134_515_008, 4 * 3_540_096 + 576
QUICKSTART_JSON = RESULTS / "quickstart_vs_zero1_100mbit_decision_rule.json"
STEPS = 10  # the quick start's run in that JSON (benchmarks/quickstart_link.py --steps 10)


def _recorded_probe() -> tuple[float, float]:
    """The link (Mbit/s) and compute (synthetic samples/s) the quick start at 100 Mbit/s logged."""
    line = json.loads(QUICKSTART_JSON.read_text())["rates"]["100mbit"]["defaults"]["strategy_line"]
    got = re.search(r"node link ([\d.]+) Mbit/s, compute ([\d.e+-]+) synthetic samples/s", line)
    assert got, line
    return float(got.group(1)), float(got.group(2))


def _auto_choice(monkeypatch, mbit: float, samples_per_s: float, goal: str) -> tuple[str, str]:
    """What the recipe's strategy=auto takes at 2 workers when its probe measures these figures:
    (the mode's name, the line it logs)."""
    monkeypatch.setattr(probe, "probe_cluster", lambda *a, **k: probe.Measured(2, 1, mbit * 1e6 / 8, 0.0, 0.0, 0))
    monkeypatch.setattr(probe, "time_compute", lambda *a, **k: samples_per_s)
    monkeypatch.setattr(probe, "model_step", lambda *a, **k: (lambda: None))
    flags = ["--max-steps", str(STEPS), "--auto-results", str(RESULTS), "--auto-goal", goal]
    cfg = finetune.engine_config(finetune.parse_args(flags), "bfloat16", Path("unused"), world=2)
    assert (cfg.strategy, cfg.global_micro_batches) == ("auto", 4)  # acco's step: 2 rounds x 2 workers
    model = torch.nn.Linear(TRAINED, 1, bias=False)  # only the trained count reaches the planner's time model
    dims = SimpleNamespace(device=torch.device("cpu"), rank=0, world=2, comm=lambda name: SimpleNamespace(group=None))
    out, choice = choose_strategy(cfg, model, dims)
    name = re.match(r"strategy=auto -> (\S+?)[: ]", choice.why).group(1)
    assert (out.strategy, out.codec, out.param_codec) == (choice.strategy, choice.codec, choice.param_codec)
    return name, choice.why


def _planner_choice(tmp_path: Path, mbit: float, samples_per_s: float, goal: str) -> tuple[str | None, str]:
    """What ``python -m engine.plan`` recommends for the same figures, in the probe's units."""
    out = tmp_path / f"plan_{mbit:g}_{goal}.json"
    plan_main(["--params", str(SMOLLM2_PARAMS), "--layers", "30", "--hidden", "576", "--vocab", "49152",
               "--seq-len", "512", "--trainable-fraction", repr(TRAINED / SMOLLM2_PARAMS), "--cpu-testbed",
               "--nodes", "2", "--gpus-per-node", "1", "--inter-gbit", repr(mbit / 1e3),
               "--samples-per-s", repr(samples_per_s), "--global-batch", "4", "--micro-batch", "1",
               "--steps", str(STEPS), "--compute-dtype", "bfloat16", "--goal", goal, "--results", str(RESULTS),
               "--json", str(out)])
    doc = json.loads(out.read_text())
    return doc["recommended"], doc["why"]


@pytest.mark.parametrize("goal", ["loss_per_sample", "time_to_loss"])
def test_the_quick_starts_auto_takes_the_planners_recommendation_for_its_probed_link(tmp_path, monkeypatch,
                                                                                     caplog, goal):
    """At the probe figures the quick start logged over 100 Mbit/s, and at links from 20 Mbit/s to
    10 Gbit/s with that compute: the same mode, and the logged line names it."""
    mbit, rate = _recorded_probe()
    for link in (mbit, 20.0, 1000.0, 10000.0):
        with caplog.at_level(logging.INFO, logger="acco_loco"):
            auto, why = _auto_choice(monkeypatch, link, rate, goal)
        planned, plan_why = _planner_choice(tmp_path, link, rate, goal)
        if planned is None:  # the rule takes nothing: auto runs the synchronous round and says so
            assert auto == "zero1" and "the rule took nothing" in why, (link, goal, why, plan_why)
        else:
            assert auto == planned, (link, goal, why, plan_why)
        assert f"strategy=auto -> {auto}" in caplog.text  # what the recipe's first lines show
        caplog.clear()
