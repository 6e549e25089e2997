"""The planner follows the run's optimizer as the engine does: it leaves out what EngineConfig
refuses with it (Muon: a strategy that does not step an owner's whole shard, its state on the
CPU), prices Muon's state as the engine holds it (the whole spare, never piece-sized scratch;
tests/engine/test_memory_accounting.py measures it), and names the optimizer in its text. No processes."""

from __future__ import annotations

import pytest

from benchmarks.plan_validate import RESULTS
from benchmarks.projections import MFU
from engine import EngineConfig
from engine.auto import decide_auto
from engine.parallel.topology import Layout
from engine.planner.goal import Goal
from engine.planner.hardware import gpu
from engine.planner.memory import memory_per_gpu
from engine.planner.modes import Mode, candidates, runs_with
from engine.planner.recommend import format_plan, make_plan
from engine.planner.shape import PRESETS
from engine.planner.timeline import Batch
from engine.planner.wire import WireSettings


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "muon"])
def test_the_planner_leaves_out_exactly_what_the_config_refuses(optimizer):
    refused = 0
    for mode in candidates(two_level=True):
        if mode.is_ddp:
            continue
        settings = dict(mode.engine_settings(), lr=1e-3)
        EngineConfig(**settings)  # every candidate runs with AdamW
        if runs_with(mode, optimizer):
            EngineConfig(**settings, optimizer=optimizer)
        else:
            refused += 1
            with pytest.raises(ValueError, match="muon"):
                EngineConfig(**settings, optimizer=optimizer)
    # Muon: the local-step strategies, 1-bit Adam and every offloaded row are out; nothing else is
    assert (refused > 0) == (optimizer == "muon")


def test_muon_state_is_priced_with_the_whole_spare():
    shape, layout = PRESETS["8b"], Layout(8, 8)
    for mode in (Mode("acco", "loco4", "int4", "two-level"), Mode("zero1", exchange="two-level", sharding="node")):
        adamw = memory_per_gpu(mode, shape, layout, WireSettings(compute_bytes=2))
        muon = memory_per_gpu(mode, shape, layout, WireSettings(compute_bytes=2, optimizer="muon"))
        whole = memory_per_gpu(mode, shape, layout, WireSettings(compute_bytes=2, step_copy="whole"))
        assert muon == whole  # what the engine resolves step_copy 'auto' to for Muon on a GPU
        # AdamW on a GPU proposes into piece-sized scratch: Muon holds the 12-byte spare of every owned
        # value (flat, or over the node and the rail: a rank owns 1/N) less that scratch
        owned = shape.trainable / layout.world
        assert 11 * owned < muon.optimizer - adamw.optimizer < 12 * owned


def test_a_muon_plan_recommends_only_what_runs_with_muon():
    shape, layout, hw = PRESETS["70b"], Layout(8, 8), gpu(10, mfu=MFU)
    for kind in ("loss_per_sample", "time_to_loss"):
        plan = make_plan(shape, layout, hw, Batch(256, 1), WireSettings(compute_bytes=2), results=RESULTS,
                         goal=Goal(kind, optimizer="muon"))
        assert all(runs_with(r.mode, "muon") for r in plan.rows)
        assert not any(r.mode.offload == "cpu" or r.mode.local_steps for r in plan.rows)
        for pick in (plan.choice, plan.soonest):
            assert pick is None or runs_with(pick.mode, "muon")
        assert "AdamW" not in format_plan(plan)  # the table's columns and the recommendation speak of Muon
    # AdamW's plan at the same scale keeps the offloaded rows
    adamw = make_plan(shape, layout, hw, Batch(256, 1), WireSettings(compute_bytes=2), results=RESULTS)
    assert any(r.mode.offload == "cpu" for r in adamw.rows)


def test_auto_with_muon_never_takes_a_mode_the_config_refuses():
    cfg = EngineConfig(strategy="auto", optimizer="muon", global_micro_batches=16, auto_goal="time_to_loss")
    choice, _, rows = decide_auto(cfg, PRESETS["70b"], Layout(8, 8), gpu(10, mfu=MFU), WireSettings(compute_bytes=2),
                                  RESULTS, None, batch=Batch(256, 1))
    assert rows and all(runs_with(r.mode, "muon") for r in rows)
    if choice is not None:
        EngineConfig(**choice.mode.engine_settings(), optimizer="muon")


def test_the_ddp_reference_with_muon_is_priced_from_torch_optimizers_state():
    # the benchmark's torch DDP + Muon (one momentum for the hidden matrices, AdamW's two moments for
    # the rest), stepped once: the planner's reference row bounds its state from above, within the tied
    # head's slack, and holds less than AdamW's two moments on everything
    import torch

    from benchmarks.worker import ddp_optimizers
    from engine.planner.shape import from_shape
    from lm.models import tiny_gpt2

    vocab, layers, hidden = 512, 2, 64
    model = tiny_gpt2(vocab_size=vocab, n_layer=layers, n_embd=hidden, n_head=4, n_positions=65, seed=0)
    opts = ddp_optimizers(model, {"lr": 1e-3, "optimizer": "muon"})
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for opt in opts:
        opt.step()
    held = sum(t.numel() * t.element_size() for opt in opts for state in opt.state.values()
               for name, t in state.items() if name != "step")
    shape = from_shape(layers, hidden, vocab, params=sum(p.numel() for p in model.parameters()))
    ddp = Mode("torch-ddp")
    muon = memory_per_gpu(ddp, shape, Layout(1, 2), WireSettings(optimizer="muon")).optimizer
    adamw = memory_per_gpu(ddp, shape, Layout(1, 2), WireSettings()).optimizer
    assert held <= muon <= held + 4 * vocab * hidden  # GPT-2 ties its head to the embedding
    assert muon < adamw == 8 * shape.trainable
