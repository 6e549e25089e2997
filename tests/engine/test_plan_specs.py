"""The planner reads the strategies' specs (engine/strategies/spec.py) and names none of them; it
checks each mode's state and activations against the GPU's memory and never recommends one that
does not fit (issues 31 and 33)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import engine.strategies as registry
from benchmarks.plan_validate import RESULTS
from engine.parallel.topology import Layout
from engine.planner.activations import activation_bytes
from engine.planner.hardware import H100_MEM_GIB, gpu
from engine.planner.memory import memory_per_gpu
from engine.planner.modes import Mode, candidates
from engine.planner.recommend import format_plan, make_plan
from engine.planner.shape import PRESETS
from engine.planner.timeline import Batch
from engine.planner.wire import WireSettings, step_bytes

PLANNER = Path(__file__).resolve().parents[2] / "engine" / "planner"
BF16 = WireSettings(compute_bytes=2)


@pytest.fixture
def toy():
    registry.SECTIONS["toy"] = "tests.toy_section:ToyConfig"
    registry.STRATEGIES["toy_sync_sgd"] = "tests.toy_strategy:ToySyncSGD"
    try:
        yield
    finally:
        del registry.SECTIONS["toy"], registry.STRATEGIES["toy_sync_sgd"]


def test_a_strategy_registered_from_outside_shows_in_the_planners_table(toy):
    shape = PRESETS["1b"]
    plan = make_plan(shape, Layout(2, 1), gpu(10), Batch(64, 1), BF16, results=RESULTS)
    row = next(r for r in plan.rows if r.mode.strategy == "toy_sync_sgd")
    # its spec's bytes: a ring all-reduce of the fp32 gradient, which a node link carries whole at M = 2
    assert row.time.bytes.rank == pytest.approx(4 * shape.trainable, rel=1e-3)
    assert row.time.bytes.node_link == row.time.bytes.rank
    assert row.memory.total == 16 * shape.params  # its spec says every replica keeps everything in fp32
    assert not row.adamw_class and plan.choice.mode.strategy != "toy_sync_sgd"  # it never said it is AdamW
    assert "| toy_sync_sgd |" in format_plan(plan)


def test_the_planners_files_name_no_strategy(toy):
    names = sorted(registry.STRATEGIES)
    assert {"zero1", "acco", "diloco", "toy_sync_sgd"} <= set(names)
    found = []
    for path in sorted(PLANNER.glob("*.py")):
        text = path.read_text()
        for name in names:
            for m in re.finditer(rf"(?<![\w]){re.escape(name)}(?![\w])", text):
                found.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not found, found
    # and every registered strategy with a spec is a candidate, with no list of names anywhere
    assert {m.strategy for m in candidates()} == {"torch-ddp"} | {
        s for s in names if registry.strategy_class(s).spec() is not None}


def _plan_70b_or_8b(model, nodes, gbit):
    return make_plan(PRESETS[model], Layout(nodes, 8), gpu(gbit), Batch(1024, 1), BF16, results=RESULTS)


@pytest.mark.parametrize("model,nodes,gbit", [("70b", 8, 10), ("8b", 2, 1)])
def test_the_recommendation_fits_an_80gb_gpu_with_its_activations(model, nodes, gbit):
    """python -m engine.plan --model 70b --nodes 8 --gpus-per-node 8 --inter-gbit 10
    --global-batch 1024 --micro-batch 1 (and 8B on 2 x 8 at 1 Gbit/s)."""
    plan = _plan_70b_or_8b(model, nodes, gbit)
    limit = H100_MEM_GIB * 2**30
    assert plan.memory_limit == limit
    c = plan.choice
    assert c is not None and c.fits, plan.why
    assert c.memory.total + c.activations <= limit
    assert c.activations == activation_bytes(PRESETS[model], 1, 2, c.checkpointing) > 0
    for r in plan.rows:  # the column says what the formulas say; checkpointing only where it makes a row fit
        assert r.fits == (r.memory.total + r.activations <= limit), r.mode.name
        assert r.fits or not r.checkpointing, r.mode.name
    assert plan.soonest is None or plan.soonest.fits
    if model == "70b":  # unsharded, no mode fits: the state alone is over 80 GB per GPU
        assert not any(r.fits for r in plan.rows if r.mode.sharding == "none")
        assert c.mode.sharding == "node" and c.checkpointing
        plain = make_plan(PRESETS[model], Layout(nodes, 8), gpu(gbit), Batch(1024, 1), BF16, modes=[c.mode],
                          checkpointing="off")
        assert not plain.rows[-1].fits  # it fits only checkpointed, and pays the recompute for it
        assert c.time.compute_s == pytest.approx(plain.rows[-1].time.compute_s * 4 / 3, rel=0.03)


def test_node_sharding_divides_the_model_state_by_g_and_keeps_the_node_link_bytes():
    shape, layout = PRESETS["8b"], Layout(8, 8)
    for mode in (Mode("zero1", exchange="two-level"), Mode("acco", "loco4", "int4", exchange="two-level")):
        sharded = Mode(mode.strategy, mode.codec, mode.param_codec, "two-level", sharding="node")
        one, node = memory_per_gpu(mode, shape, layout, BF16), memory_per_gpu(sharded, shape, layout, BF16)
        block = 2 * 2 * shape.params / shape.layers  # FSDP2's unsharded block in use and the one prefetched
        # parameters and gradients (and their comm-side copies) at 1/G of the unsharded run's, at most
        assert node.params + node.grads - block <= (one.params + one.grads) / 8 * 1.0001
        assert node.optimizer == one.optimizer and node.codec_state == one.codec_state  # already 1/(G M), 1/G
        # the same bytes over the rails under grad_dtype auto (an uncompressed gradient stays bf16 on
        # both; a codec's bytes do not depend on the buffer); with float32 the unsharded run's
        # uncompressed gradient sends 2 bytes a value more (FSDP2's stays the parameters' bf16)
        assert step_bytes(shape.trainable, layout, sharded, BF16).node_link == \
            step_bytes(shape.trainable, layout, mode, BF16).node_link
        fp32 = WireSettings(compute_bytes=2, grad_dtype="float32")
        fp32_whole = step_bytes(shape.trainable, layout, mode, fp32).node_link
        auto_whole = step_bytes(shape.trainable, layout, mode, BF16).node_link
        if mode.codec == "none":
            assert fp32_whole - auto_whole == pytest.approx(7 / 8 * 2 * shape.trainable, rel=1e-3)
        else:
            assert fp32_whole == auto_whole
    with pytest.raises(ValueError, match="two-level"):
        Mode("zero1", sharding="node")


def test_checkpointing_stores_block_inputs_only():
    shape = PRESETS["70b"]
    tokens, h, L = shape.seq_len, shape.hidden, shape.layers
    logits = tokens * shape.vocab * (2 + 8)
    assert activation_bytes(shape, 1, 2, False) == L * 34 * tokens * h + logits  # Korthikanti et al.'s 34 s b h
    assert activation_bytes(shape, 1, 2, True) == L * 2 * tokens * h + 34 * tokens * h + logits
    assert activation_bytes(shape, 2, 2, True) == 2 * activation_bytes(shape, 1, 2, True)
    # checkpointing costs a forward pass: the step's compute grows by about a third
    assert 1.3 < shape.flops_per_sample(True) / shape.flops_per_sample() < 1.4


def test_when_nothing_fits_it_says_what_would_and_that_holds():
    # 70B on one node of 8 at micro-batch 4, checkpointing off: nothing fits, and no one change is
    # enough; the changes it names, taken together, do fit
    args = (PRESETS["70b"], gpu(10), BF16)
    plan = make_plan(args[0], Layout(1, 8), args[1], Batch(1024, 4), args[2], results=RESULTS, checkpointing="off")
    assert plan.choice is None and "Nothing to recommend" in format_plan(plan)
    assert "no one change being enough" in plan.why and "activation checkpointing" in plan.why, plan.why
    nodes = int(re.search(r"--nodes (\d+)", plan.why).group(1))
    mb = 1 if "--micro-batch 1" in plan.why else 4
    again = make_plan(args[0], Layout(nodes, 8), args[1], Batch(1024, mb), args[2], results=RESULTS)
    assert again.choice is not None and again.choice.fits and nodes > 1
    # one change is enough at 8 nodes of 8 with checkpointing off: it names it, and it holds
    plan = make_plan(args[0], Layout(8, 8), args[1], Batch(1024, 1), args[2], results=RESULTS, checkpointing="off")
    assert plan.choice is None and "one change at a time" in plan.why, plan.why
    assert "activation checkpointing" in plan.why
    on = make_plan(args[0], Layout(8, 8), args[1], Batch(1024, 1), args[2], results=RESULTS, checkpointing="on")
    assert on.choice is not None and on.choice.fits


def test_the_cli_needs_a_results_folder(tmp_path, monkeypatch, capsys):
    from engine.plan import main

    monkeypatch.chdir(tmp_path)  # no ./docs/results here
    with pytest.raises(SystemExit, match="no results folder.*--results"):
        main(["--model", "1b", "--nodes", "2"])
    assert main(["--model", "1b", "--nodes", "2", "--gpus-per-node", "8", "--global-batch", "256",
                 "--results", str(RESULTS)]) == 0
    assert "fits of 79.6 GiB" in capsys.readouterr().out
