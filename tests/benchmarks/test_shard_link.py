"""benchmarks/shard_link.py's arithmetic without the testbed: the node link's bytes between two
step commits interpolated from the polled counters, and the docs table from a result."""

from __future__ import annotations

import pytest

from benchmarks.shard_link import LinkPoller, render


def test_link_bytes_are_interpolated_between_polls():
    poll = LinkPoller.__new__(LinkPoller)  # no testbed: the samples are given
    poll.samples = [(10.0, [0, 100]), (12.0, [400, 300]), (14.0, [400, 1300])]
    assert poll.at(11.0) == [200.0, 200.0]
    assert poll.at(12.0) == [400.0, 300.0]
    assert poll.at(13.5) == [400.0, 1050.0]
    with pytest.raises(ValueError):
        poll.at(9.0)  # before the first poll: nothing to interpolate from


def _run(loss_after: float, link: list[float], held: int) -> dict:
    return {"eval": [{"tag": "before", "step": 0, "samples_total": 0, "eval_loss": 2.0},
                     {"tag": "after", "step": 10, "samples_total": 160, "eval_loss": loss_after}],
            "train_loss": [2.1, 1.9], "node_link_bytes_per_step": link,
            "engine_inter_bytes_per_step_per_rank": [1e6, 1e6, 1e6, 1e6], "s_per_step_under_load": 3.0,
            "memory_per_rank": [{"held_bytes": {"parameters": held, "gradients": held}, "rss_bytes": 5e8,
                                 "peak_rss_bytes": 9e8}] * 4}


def test_render_puts_the_two_runs_side_by_side():
    result = {"runs": {"unsharded": _run(1.5, [2e6, 2e6], 10**9), "sharded": _run(1.503, [2e6, 2.1e6], 4 * 10**8)},
              "formula": {"unsharded": {"memory_bytes": 2.1e9}, "sharded": {"memory_bytes": 0.9e9}}}
    table = render(result).splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table[2:]}
    assert rows["held-out loss vs unsharded"] == ["+0.000%", "+0.200% |"]
    assert rows["node 0 / node 1 link, MB/step (veth, training window)"] == ["2.00 / 2.00", "2.00 / 2.10 |"]
    assert rows["held per rank, MB (memory_accounting; max over ranks)"] == ["2000", "800 |"]
    assert rows["formula per rank, MB (engine/planner/memory.py)"] == ["2100", "900 |"]
