"""Every strategy against a float64 sequential reference of its equations, at world size 1, 2, 3."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

STEPS, K = 20, 2
STRATEGIES = ("zero1", "dpu", "acco")


def run_engine(rank: int, world: int, strategy: str, opt: str = "adamw", steps: int = STEPS, chunks: int = 1,
               step_copy: str = "auto"):
    """Train with fixed accumulation; return the compute params after every committed step."""
    model = tiny_model(seed=0)
    cfg = EngineConfig(strategy=strategy, optimizer=opt, lr=1e-2, micro_batches=K,
                       accumulation="fixed", max_steps=steps, align=8,
                       weight_decay=0.1 if opt == "adamw" else 0.0, momentum=0.9, comm_chunks=chunks,
                       step_copy=step_copy)
    engine = Engine(model, cfg, mse_loss)
    it = iter(worker_stream(rank, 3 * K * (steps + 1)))
    snapshots = []
    for t in range(steps):
        hist = engine.fit(it, steps=1)
        assert [h["step"] for h in hist] == [t + 1]
        snapshots.append(flat_params(model))
    engine.close()
    return snapshots


def reference(world: int, strategy: str, opt: str = "adamw", steps: int = STEPS):
    streams = [worker_stream(r, 3 * K * (steps + 1)) for r in range(world)]
    kwargs = {"weight_decay": 0.1} if opt == "adamw" else {"momentum": 0.9}
    return Reference(tiny_model(seed=0), streams, K, opt=opt, lr=1e-2, **kwargs).run(strategy, steps)


def _all_strategies(rank: int, world: int, step_copy: str = "auto"):
    # chunked collectives (several async pieces per collective) must not change a single bit
    return {s: run_engine(rank, world, s, chunks=1 if s == "zero1" else 3, step_copy=step_copy) for s in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("step_copy", ["whole", "piece"])  # the step proposed into a spare, or into scratch
def test_world1_matches_reference(strategy, opt, step_copy):
    got = run_engine(0, 1, strategy, opt, chunks=3 if step_copy == "piece" else 1, step_copy=step_copy)
    want = reference(1, strategy, opt)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) < 1e-6, errs
    # the trajectory moved: a no-op engine would fail the comparison above only weakly
    assert rel_err(want[-1], flat_params(tiny_model(seed=0))) > 1e-2


@pytest.mark.parametrize("world", [2, 3])
def test_process_groups_match_reference_and_stay_identical(world):
    check_process_groups(spawn(_all_strategies, world), world)


def test_piece_scratch_in_a_process_group_matches_reference():
    """step_copy='piece': each piece proposed into a scratch slot and sent, the step recomputed in
    place into the state at install (zero1 in one piece, dpu and acco in 3)."""
    check_process_groups(spawn(_all_strategies, 2, "piece"), 2)


def check_process_groups(results, world: int) -> None:
    for strategy in STRATEGIES:
        want = reference(world, strategy)
        for step in range(STEPS):
            mine = results[0][strategy][step]
            for r in range(1, world):  # every replica bit-identical after every step
                assert torch.equal(results[r][strategy][step], mine), (strategy, step, r)
            err = rel_err(mine, want[step])
            assert err < 1e-6, (strategy, step, err)


def test_strategies_differ():
    """The three references are really different computations (guards the test above)."""
    finals = {s: reference(1, s)[-1] for s in STRATEGIES}
    assert rel_err(finals["dpu"], finals["zero1"]) > 1e-4
    assert rel_err(finals["acco"], finals["zero1"]) > 1e-4


def test_zero1_world1_matches_torch_adamw():
    torch.manual_seed(1)
    model_a, model_b = tiny_model(seed=3), tiny_model(seed=3)
    data = worker_stream(0, STEPS, batch=16)
    engine = Engine(model_a, EngineConfig(strategy="zero1", lr=3e-3, weight_decay=0.05, betas=(0.8, 0.95),
                                          micro_batches=1, accumulation="fixed", max_steps=STEPS), mse_loss)
    engine.fit(data)
    engine.close()
    opt = torch.optim.AdamW(model_b.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.8, 0.95))
    for batch in data:
        opt.zero_grad()
        mse_loss(model_b, batch).backward()
        opt.step()
    assert rel_err(flat_params(model_a), flat_params(model_b)) < 1e-6
