"""comm_chunks="auto" (the default): how many pieces a collective is split into, from the shard
size and the backend; every rank resolves the same number, and the result does not depend on it
(tests/engine/test_pipelined_rounds.py shows any number of pieces gives the same bits)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.comm import AUTO_CHUNKS, MIN_PIECE, resolve_chunks
from recipes.finetune import build_parser
from tests.tiny import mse_loss, tiny_model


def test_auto_splits_large_gloo_shards_into_pieces_of_at_least_min_piece():
    cpu = torch.device("cpu")
    assert resolve_chunks("auto", 1000, cpu) == 1  # a small shard: one piece
    assert resolve_chunks("auto", 3 * MIN_PIECE, cpu) == 3
    assert resolve_chunks("auto", 7_000_000, cpu) == AUTO_CHUNKS  # the quick start's 14M / 2 workers
    assert resolve_chunks("auto", 7_000_000, torch.device("cuda", 0)) == 1  # NCCL pipelines inside
    assert resolve_chunks(5, 10, cpu) == 5  # a number is taken as it is


def test_the_engine_resolves_auto_and_keeps_a_number():
    auto = Engine(tiny_model(0), EngineConfig(strategy="zero1", align=8, max_steps=1), mse_loss)
    fixed = Engine(tiny_model(0), EngineConfig(strategy="zero1", align=8, max_steps=1, comm_chunks=3), mse_loss)
    assert EngineConfig().comm_chunks == "auto"
    assert auto.comm.chunks == 1 and fixed.comm.chunks == 3
    auto.close(), fixed.close()


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("8", 8)])
def test_the_recipe_flag_takes_auto_or_a_count(text, value):
    assert getattr(build_parser().parse_args(["--comm-chunks", text]), "comm_chunks") == value
