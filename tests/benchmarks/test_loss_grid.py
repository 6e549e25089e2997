"""The loss grid's bookkeeping (benchmarks/loss_grid.py) on made-up runs: which run comes next, the
lr sweep and its extension past an end, resuming from what a JSON holds, and the gap to DDP."""

from __future__ import annotations

import pytest

from benchmarks import loss_grid as g


def doc_with(runs, b=16, failures=()):
    doc = g.new_doc(b, 2048)
    doc["runs"] = [{"mode": m, "lr": lr, "seed": s, "final_loss": x,
                    "evals": [{"samples": 1024, "loss": x + 0.5}, {"samples": 2048, "loss": x}]}
                   for m, lr, s, x in runs]
    doc["failures"] = [{"mode": m, "lr": lr, "seed": s} for m, lr, s in failures]
    return doc


def test_centre_lr_doubles_every_four_fold_batch():
    assert [g.centre_lr(b) for b in g.BATCHES] == pytest.approx([g.BASE_LR * f for f in (1, 1, 2, 2, 4)])


def test_seed0_sweeps_every_mode_at_the_centre_first():
    modes = ("torch-ddp", "acco")
    assert g.next_runs(doc_with([]), modes) == [("torch-ddp", 2e-3, 0), ("acco", 2e-3, 0)]
    after_centre = doc_with([("torch-ddp", 2e-3, 0, 3.0), ("acco", 2e-3, 0, 3.1)])
    assert g.next_runs(after_centre, modes) == [("torch-ddp", 1e-3, 0), ("acco", 1e-3, 0)]


def test_the_sweep_goes_past_an_end_that_is_best_then_later_seeds_run_at_the_best():
    modes = ("torch-ddp",)
    edge = doc_with([("torch-ddp", 1e-3, 0, 3.2), ("torch-ddp", 2e-3, 0, 3.1), ("torch-ddp", 4e-3, 0, 3.0)])
    assert g.next_runs(edge, modes) == [("torch-ddp", 8e-3, 0)]
    inside = doc_with([("torch-ddp", 1e-3, 0, 3.2), ("torch-ddp", 2e-3, 0, 3.1), ("torch-ddp", 4e-3, 0, 3.0),
                       ("torch-ddp", 8e-3, 0, 3.05)])
    assert g.next_runs(inside, modes) == [("torch-ddp", 4e-3, 1)]
    done = doc_with([*[("torch-ddp", lr, 0, x) for lr, x in ((1e-3, 3.2), (2e-3, 3.1), (4e-3, 3.3))],
                     ("torch-ddp", 2e-3, 1, 3.12)])
    assert g.next_runs(done, modes) == []
    # an lr that keeps failing counts as the worst, and is not tried a third time
    failing = doc_with([("torch-ddp", 1e-3, 0, 3.2), ("torch-ddp", 2e-3, 0, 3.1)],
                       failures=[("torch-ddp", 4e-3, 0)] * g.MAX_FAILURES)
    assert g.next_runs(failing, modes) == [("torch-ddp", 2e-3, 1)]


def test_a_sweep_stuck_on_the_plateau_is_also_run_at_ddps_best_lr():
    # B = 256 at 12288 samples, seed 0: acco+loco4's three lrs ended within noise of the unigram
    # plateau with the middle one best, so its own sweep stopped above the lr where DDP learned
    modes = ("torch-ddp", "acco+loco4")
    ddp = [("torch-ddp", lr, 0, x) for lr, x in ((1e-3, 2.79), (2e-3, 2.65), (4e-3, 3.07), (8e-3, 3.32),
                                                            (1.6e-2, 3.29))]
    plateau = [("acco+loco4", lr, 0, x) for lr, x in ((4e-3, 3.314), (8e-3, 3.308), (1.6e-2, 3.324))]
    assert g.next_runs(doc_with([*ddp, *plateau], b=256), modes) == [("acco+loco4", 2e-3, 0), ("torch-ddp", 2e-3, 1)]
    # once there and best, the usual extension goes on below it
    there = doc_with([*ddp, *plateau, ("acco+loco4", 2e-3, 0, 2.75)], b=256)
    assert g.next_runs(there, modes) == [("acco+loco4", 1e-3, 0), ("torch-ddp", 2e-3, 1)]
    # before DDP's sweep is done nothing is added
    assert g.next_runs(doc_with([*ddp[:2], *plateau], b=256), modes)[0] == ("torch-ddp", 8e-3, 0)


def test_the_extension_stops_after_max_extra_lrs():
    lrs = [2e-3 * 2 ** k for k in range(-1, 1 + g.MAX_EXTRA_LRS + 1)]
    tried = {g.lr_key(lr): 3.0 - 0.01 * i for i, lr in enumerate(lrs)}  # the largest is always best
    assert len(tried) == 3 + g.MAX_EXTRA_LRS
    assert g.next_sweep_lr(tried, 2e-3) is None


def test_plan_resumes_at_the_first_cell_with_work_left():
    modes = ("torch-ddp",)
    full = doc_with([*[("torch-ddp", lr, 0, x) for lr, x in ((1e-3, 3.2), (2e-3, 3.1), (4e-3, 3.3))],
                     ("torch-ddp", 2e-3, 1, 3.12)])
    docs = {(16, 2048): full, (64, 2048): doc_with([], b=64)}
    assert g.plan(docs, [(16, 2048), (64, 2048)], modes, 2) == ((64, 2048), "torch-ddp", 4e-3, 0)
    assert g.plan({(16, 2048): full}, [(16, 2048)], modes, 2) is None


def test_summary_gap_is_seed_against_seed_at_each_modes_best_lr():
    doc = doc_with([("torch-ddp", 1e-3, 0, 3.0), ("torch-ddp", 2e-3, 0, 2.0), ("torch-ddp", 4e-3, 0, 2.5),
                    ("acco", 1e-3, 0, 2.2), ("acco", 2e-3, 0, 2.1), ("acco", 4e-3, 0, 2.4),
                    ("torch-ddp", 2e-3, 1, 2.0), ("acco", 2e-3, 1, 2.02)])
    s = g.summarize(doc)
    assert s["acco"]["best_lr"] == 2e-3 and s["acco"]["best_lr_inside_sweep"] is True
    assert s["acco"]["gap_vs_ddp_pct"] == {"0": pytest.approx(5.0), "1": pytest.approx(1.0)}
    assert s["acco"]["gap_vs_ddp_pct_mean"] == pytest.approx(3.0)
    assert s["acco"]["gap_vs_ddp_pct_over_run"]["0"][0] == [1024, pytest.approx(100 * (2.6 / 2.5 - 1))]


def test_the_2x2_grid_centres_each_mode_on_its_2x1_best_and_is_read_as_the_two_level_exchange(tmp_path, monkeypatch):
    """A 2 x 2 point's sweep starts at each codec mode's best lr of the 2 x 1 grid (the B rule where
    that point has none), its JSON sits beside the 2 x 1 one, and the planner's evidence reads its
    rows as the two-level exchange's, against DDP's run at 4 ranks."""
    import json

    from engine.planner.evidence import all_points

    monkeypatch.setattr(g, "OUT_DIR", str(tmp_path / "loss_grid"))
    flat = doc_with([("acco+loco4", 1e-3, 0, 3.0), ("acco+loco4", 2e-3, 0, 3.2), ("acco+loco4", 4e-3, 0, 3.4)], b=64)
    flat["samples"] = 3072
    g.save_doc(flat)
    doc = g.new_doc(64, 3072, "2x2")
    assert g.json_path(64, 3072, "2x2").endswith("loss_grid/b64_n3072_2x2.json")
    assert doc["workload"]["ranks_per_node"] == 2 and doc["workload"]["workers"] == 4
    centres = doc["lr_rule"]["centre_by_mode"]
    assert centres["acco+loco4@two_level"] == 1e-3 and centres["torch-ddp"] == g.centre_lr(64)
    modes = ("torch-ddp", "acco+loco4@two_level")
    assert g.next_runs(doc, modes) == [("torch-ddp", g.centre_lr(64), 0), ("acco+loco4@two_level", 1e-3, 0)]
    runs = [(m, lr, s, x) for m, base in (("torch-ddp", 3.0), ("acco+loco4@two_level", 3.03))
            for lr, s, x in ((centres[m] / 2, 0, base + 0.2), (centres[m], 0, base), (centres[m] * 2, 0, base + 0.1),
                             (centres[m], 1, base))]
    doc["runs"] = doc_with(runs, b=64)["runs"]
    g.save_doc(doc)
    (tmp_path / "loss_grid" / "b64_n3072.json").unlink()  # only the 2 x 2 point is evidence here
    points = [p for p in all_points(tmp_path, ()) if p.kind == "grid"]
    assert [(p.key, p.bench, p.seeds) for p in points] == [("acco|loco4|int8|two-level", "acco+loco4@two_level",
                                                            (0, 1))]
    assert points[0].gap_pct == pytest.approx(1.0) and "2 nodes x 2 ranks" in points[0].workload
    assert json.loads((tmp_path / "loss_grid" / "b64_n3072_2x2.json").read_text())["layout"] == "2x2"
