"""ParallelDims (engine/parallel/dims.py): the exchange each layout and strategy get, the one
place that makes process groups, and a group's refusal of a second thread."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.parallel.comm import Comm
from engine.parallel.dims import ROLES, ParallelDims
from engine.parallel.topology import Layout
from engine.strategies import strategy_class

ROOT = Path(__file__).resolve().parents[2]


def _dims(nodes: int, g: int) -> ParallelDims:
    return ParallelDims(Layout(nodes, g), None, 0, nodes * g, torch.device("cpu"))


@pytest.mark.parametrize("nodes,g,cfg,kind", [
    (1, 4, {}, "flat"),  # one node: the flat exchange is the two-level one
    (4, 1, {}, "flat"),  # one rank per node: the testbed's layout
    (2, 2, {}, "two_level"),
    (2, 2, {"topology": "flat"}, "flat"),
    (2, 2, {"strategy": "local_sgd", "optimizer": "sgd", "weight_decay": 0.0}, "flat"),  # auto: it has no two-level
    (2, 2, {"strategy": "diloco"}, "two_level"),  # a node as one replica
    (2, 2, {"model_sharding": "node"}, "node_sharded"),
    (1, 2, {"model_sharding": "node"}, "node_sharded"),
])
def test_the_exchange_follows_the_layout_and_what_the_strategy_supports(nodes, g, cfg, kind):
    cfg = EngineConfig(**cfg)
    assert _dims(nodes, g).decide(cfg, strategy_class(cfg.strategy)).kind == kind


@pytest.mark.parametrize("nodes,g,cfg,fragment", [
    (2, 2, {"strategy": "local_sgd", "optimizer": "sgd", "weight_decay": 0.0, "topology": "two_level"},
     "strategy 'local_sgd' has no two-level exchange yet"),
    (1, 4, {"topology": "two_level"}, "topology='two_level' needs at least 2 nodes of at least 2 ranks"),
])
def test_a_layout_the_strategy_cannot_run_is_refused_with_what_to_do(nodes, g, cfg, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):  # by the config, or once the layout is known
        cfg = EngineConfig(**cfg)
        _dims(nodes, g).decide(cfg, strategy_class(cfg.strategy))


def test_deciding_keeps_the_groups_made_so_far():
    dims = _dims(1, 1)
    control = dims.comm("control")  # world 1: no group, its collectives are copies
    decided = dims.decide(EngineConfig(), strategy_class("zero1"))
    assert decided.comm("control") is control and decided.counter is dims.counter


def test_a_group_refuses_a_second_thread():
    comm = Comm(0, 2, name="world")  # two ranks: the check runs before any collective
    comm._enter()  # this thread issues its collectives
    errors = []

    def other():
        try:
            comm.all_reduce_sum(torch.zeros(1))
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=other, name="intruder")
    t.start()
    t.join()
    assert errors and "'world' group was used from thread 'intruder'" in errors[0]


def test_every_role_names_a_span_and_a_thread():
    assert all(span in ("world", "node", "rail") and thread in ("compute", "comm") for span, thread in ROLES.values())
    # the comm thread and the compute thread never share a role's group
    assert {r for r, (_, t) in ROLES.items() if t == "comm"} == {"world", "node", "rail"}


def test_one_place_makes_process_groups():
    makers = re.compile(r"\b(new_group|new_subgroups\w*|init_device_mesh|DeviceMesh\.from_group|split_group)\(")
    where = {str(p.relative_to(ROOT)) for p in ROOT.glob("engine/**/*.py") if makers.search(p.read_text())}
    assert where == {"engine/parallel/dims.py"}
