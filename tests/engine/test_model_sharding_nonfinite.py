"""A run whose new parameters are not finite on one shard only. Node-sharded (engine/parallel/sharding.py):
ShardParams gathers into the held buffer itself; flat: the delta gather adds each piece as it
arrives (engine/parallel/gatherers.py, ``restorable``), so the finite shard's deltas are in the
buffer before the bad one is seen. Either way the round fills the buffer again from the model
before it gathers the unchanged master: nothing is installed anywhere and every replica stays as it was."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.engine.test_model_sharding import whole_params
from tests.tiny import worker_stream


def _one_row_model():
    """Two output rows, one per local rank of a node (FSDP2's Shard(0) cut over 2): the loss
    weighs output 0 by 1e10 and output 1 by 1e-4, so at lr 1e30 row 0's update overflows and row
    1's (local rank 1's shard, rail 1) is finite and large: added early, it would show."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 2, bias=False))


def _loss(model, batch):
    out, mse = model(batch[0][:, :4]), torch.nn.functional.mse_loss
    return 1e10 * mse(out[:, 0], batch[1][:, 0]) + 1e-4 * mse(out[:, 1], batch[1][:, 1])


def _overflow(rank: int, world: int, strategy: str, param_codec: str, sharding: str = "node"):
    cfg = EngineConfig(strategy=strategy, optimizer="sgd", momentum=0.0, lr=1e30, micro_batches=1,
                       accumulation="fixed", max_steps=2, align=8, group_size=8, param_codec=param_codec,
                       nan_policy="skip", model_sharding=sharding)
    model = _one_row_model()
    engine = Engine(model, cfg, _loss)
    before = whole_params(model)
    history = engine.fit(worker_stream(rank, 20))
    after = whole_params(model)
    engine.close()
    return {"skipped": [h["skipped"] for h in history], "bad": history[0]["bad_ranks"],
            "kept": torch.equal(before, after), "after": after}


# acco and dpu gather into the gradient buffer they have reduced (deltas added early stay in it
# until the round fills it again); zero1 into its one gradient buffer, refilled from FSDP2's shards
@pytest.mark.parametrize("strategy,param_codec", [("acco", "int8"), ("dpu", "int4"), ("zero1", "int8"),
                                                  ("zero1", "auto")])
def test_a_nonfinite_update_on_one_rail_is_installed_nowhere(strategy, param_codec):
    runs = spawn(_overflow, 4, strategy, param_codec, env={"LOCAL_WORLD_SIZE": "2"})
    for run in runs:
        assert all(run["skipped"]) and run["kept"], run
        # row 0's 4 values are chunk 0 of rail 0's buffer (8 values a chunk): rank (0, 0)'s new
        # shard overflowed; rail 1 (rank 1, its chunk with row 1) was finite, and adds nothing
        assert run["bad"] == [0], run
        assert torch.equal(run["after"], runs[0]["after"])


@pytest.mark.parametrize("strategy", ["acco", "zero1"])
def test_a_nonfinite_update_on_one_shard_is_installed_nowhere_flat(strategy):
    """World 2, no model sharding, int4 deltas: rank 0's shard (output row 0) overflows, rank 1's
    is finite and large and arrives in the same piece."""
    runs = spawn(_overflow, 2, strategy, "int4", "none")
    for run in runs:
        assert all(run["skipped"]) and run["kept"], run
        assert run["bad"] == [0], run
        assert torch.equal(run["after"], runs[0]["after"])
