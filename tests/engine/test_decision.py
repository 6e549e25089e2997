"""The one decision rule (engine/planner/decide.py): strategy="auto" and the planner's
recommendation agree, nothing is recommended without measured rows of its own, and the loss model
interpolates in B and run length without extrapolating (engine/planner/evidence.py). No processes."""

from __future__ import annotations

import json

import pytest

from benchmarks.plan_validate import RESULTS
from benchmarks.projections import GLOBAL_BATCH, MFU, MICRO_BATCH
from engine import EngineConfig
from engine.auto import auto_modes, decide_auto
from engine.parallel.topology import Layout
from engine.planner.evidence import (
    Point,
    all_points,
    estimate,
    evidence_key,
    interpolate,
)
from engine.planner.goal import Goal
from engine.planner.hardware import gpu
from engine.planner.modes import Mode
from engine.planner.quality import bench_mode, bench_name
from engine.planner.recommend import make_plan
from engine.planner.shape import PRESETS
from engine.planner.timeline import Batch
from engine.planner.wire import WireSettings

BF16 = WireSettings(compute_bytes=2)
GRID = [(model, nodes, link) for model in ("1b", "8b", "70b") for nodes in (2, 8, 64) for link in (1, 10, 100)]


SETTINGS = [("none", "none"), ("node", "none"), ("node", "cpu")]  # (model_sharding, optimizer_offload)


def _both(model, nodes, link, goal, sharding, offload):
    shape, layout, hw = PRESETS[model], Layout(nodes, 8), gpu(link, mfu=MFU)
    batch = Batch(GLOBAL_BATCH, MICRO_BATCH)
    plan = make_plan(shape, layout, hw, batch, BF16, results=RESULTS, goal=goal, model_sharding=sharding,
                     optimizer_offload=offload)
    cfg = EngineConfig(strategy="auto", auto_goal=goal.kind, auto_loss_bound_pct=goal.loss_bound_pct,
                       model_sharding=sharding, optimizer_offload=offload, global_micro_batches=GLOBAL_BATCH)
    choice, decision, _ = decide_auto(cfg, shape, layout, hw, BF16, RESULTS, None, batch=batch)
    return plan, choice, decision


def test_auto_and_the_planner_agree_over_the_projection_grid():
    """benchmarks/projections.py's 27 rows (1B/8B/70B, 2/8/64 nodes of 8, 1/10/100 Gbit/s), for both
    goals, with the model not sharded, sharded over the node, and sharded with the optimizer on the
    CPU (in turn, so that each goal meets each setting on 9 rows): the same choice, or neither chooses."""
    picked = set()
    for i, (model, nodes, link) in enumerate(GRID):
        for j, goal in enumerate((Goal("loss_per_sample"), Goal("time_to_loss"))):
            sharding, offload = SETTINGS[(i + j) % len(SETTINGS)]
            plan, choice, decision = _both(model, nodes, link, goal, sharding, offload)
            planned = plan.choice.mode if plan.choice else None
            auto = choice.mode if choice else None
            assert planned == auto, (model, nodes, link, goal.kind, sharding, offload, plan.why, decision.why)
            picked.add(planned)
    assert len(picked - {None}) >= 2, picked  # the grid exercises more than one answer


def test_no_projection_row_recommends_a_mode_without_its_own_measured_rows():
    for model, nodes, link in GRID:
        for goal in (Goal("loss_per_sample"), Goal("time_to_loss")):
            plan = make_plan(PRESETS[model], Layout(nodes, 8), gpu(link, mfu=MFU), Batch(GLOBAL_BATCH, MICRO_BATCH),
                             BF16, results=RESULTS, goal=goal)
            for row in (plan.choice, plan.soonest):
                if row is None or row.mode == plan.reference:
                    continue
                est = row.loss if (goal.kind == "loss_per_sample" and row is plan.choice) else row.factor
                assert est.measured and est.basis, (model, nodes, link, row.mode.name)
                key = evidence_key(row.mode)
                assert all(p.key == key and p.qualifies for p in est.basis), [p.describe() for p in est.basis]
            if plan.choice is not None and goal.kind == "loss_per_sample":
                assert plan.choice.loss.value <= goal.loss_bound_pct
                assert "B = 1024" in plan.why or not plan.choice.loss.beyond  # the run's B beside its evidence


def test_codecs_on_the_two_level_exchange_stand_on_their_own_rows_only():
    # a gradient codec on the two-level exchange compresses the node's sum, not each rank's gradient:
    # its figure comes from the grid's 2 nodes x 2 ranks points (loss_grid/*_2x2.json), never from
    # the flat runs', and the flat mode never reads the 2 x 2 points
    for codec, deltas in (("loco4", "int8"), ("loco4", "int4")):
        for strategy in ("zero1", "acco"):
            two = estimate(Mode(strategy, codec, deltas, exchange="two-level"), RESULTS, 1024, None)
            flat = estimate(Mode(strategy, codec, deltas), RESULTS, 1024, None)
            assert two.measured and two.basis, two
            assert all(p.source.endswith("_2x2.json") and p.key.endswith("|two-level") for p in two.basis), two
            assert flat.measured and not any(p.source.endswith("_2x2.json") for p in flat.basis), flat
    # the 2 x 2 points reach B = 256 only: a run below it takes the B = 256 figure and says so
    small = estimate(Mode("zero1", "loco4", "int4", exchange="two-level"), RESULTS, 16, 3072)
    assert small.beyond.startswith("beyond the evidence: evidence starts at B = ")
    # at 70B on 8 x 8, 10 Gbit/s, the codec modes' figures come from the 2 x 2 points: where reaching
    # AdamW's loss soonest is the goal a codec mode wins on them; where the loss per sample is bounded,
    # a codec mode is taken only if its own 2 x 2 figure is within the bound
    for goal in (Goal("time_to_loss"), Goal("loss_per_sample")):
        plan = make_plan(PRESETS["70b"], Layout(8, 8), gpu(10, mfu=MFU), Batch(1024, 1), BF16, results=RESULTS,
                         goal=goal)
        assert plan.choice is not None, plan.why
        codec_rows = [r for r in plan.rows if r.mode.codec == "loco4" and r.mode.exchange == "two-level"
                      and r.loss is not None and r.loss.measured]
        assert codec_rows and all(p.source.endswith("_2x2.json") for r in codec_rows for p in r.loss.basis)
        if goal.kind == "time_to_loss":
            assert plan.choice.mode.codec == "loco4", plan.why
            assert all(p.source.endswith("_2x2.json") for p in plan.choice.loss.basis), plan.why
        elif plan.choice.mode.codec == "loco4":
            assert plan.choice.loss.value <= goal.loss_bound_pct, plan.why
        else:
            assert all(r.loss.value > goal.loss_bound_pct for r in codec_rows), plan.why


def test_the_benchmarks_names_map_to_what_they_run():
    """benchmarks/modes.py: acco+loco4 and zero1+loco4 send int8 parameter deltas."""
    from benchmarks.modes import MODES

    parsed = {name: bench_mode(name) for name in MODES}
    for name, mine in parsed.items():
        bench = MODES[name]
        if mine is None:  # torch DDP's variants, ACCO's delay corrections, equal shares, grow mode, other codecs
            assert bench.strategy is None or bench.extra or bench.codec not in ("none", "loco4"), name
            continue
        assert (bench.strategy, bench.codec) == (mine.strategy, mine.codec), name
        assert set(bench.extra) <= {"topology", "inner_steps", "outer_overlap"}, name  # nothing else changed
        assert bench.param_codec == (mine.param_codec if mine.param_codec != "auto" else "float32"), name
        assert bench_name(mine) in (name.split("@")[0], "acco+loco4"), name  # acco+loco4+int8 is its alias
    assert {"zero1", "acco", "acco+loco4", "zero1+loco4", "zero1+loco4+int4params", "onebit-adam", "diloco-h15",
            "sparseloco-h15+overlap"} <= {n for n, m in parsed.items() if m is not None}
    assert bench_mode("zero1+loco4") == Mode("zero1", "loco4", "int8")
    assert bench_mode("acco+loco4+int4params@two_level") == Mode("acco", "loco4", "int4", exchange="two-level")
    assert bench_name(Mode("zero1", "loco4", "int8")) == "zero1+loco4"
    assert bench_name(Mode("acco", "loco4")) is None  # full-precision parameters with LoCo: never run
    # the exchange changes a compressed update, not an uncompressed one
    assert evidence_key(Mode("zero1", exchange="two-level", sharding="node")) == evidence_key(Mode("zero1"))
    assert evidence_key(Mode("acco", "loco4", "int4", exchange="two-level")) != evidence_key(Mode("acco", "loco4", "int4"))
    assert evidence_key(Mode("sparseloco", exchange="two-level")) != evidence_key(Mode("sparseloco"))  # node replicas


def _pt(b, n, gap, seeds=3, kind="benchmark"):
    return Point("k", "m", f"b{b}_n{n}.json", kind, b, float(n), gap, tuple(range(seeds)), (gap,) * seeds, 1 + gap / 10)


def test_interpolation_is_the_measured_value_at_a_measured_point_and_says_beyond_outside():
    pts = [_pt(16, 3072, 1.3), _pt(64, 3072, 0.5), _pt(16, 12288, 0.8), _pt(64, 12288, 0.1)]
    for p in pts:
        got = interpolate(pts, p.global_batch, p.samples)
        assert got.value == pytest.approx(p.gap_pct) and not got.beyond
        assert got.evidence() == f"B {p.global_batch}, {p.samples:.0f} samples"
    mid = interpolate(pts, 32, 3072)  # half-way in log B
    assert mid.value == pytest.approx(0.9) and not mid.beyond and mid.evidence() == "B 16-64, 3072 samples"
    corner = interpolate(pts, 32, 6144)  # half-way in both
    assert corner.value == pytest.approx((1.3 + 0.5 + 0.8 + 0.1) / 4)
    big = interpolate(pts, 1024, 12288, label="the 70B run")
    assert big.value == pytest.approx(0.1)  # the largest measured B's figure, never extrapolated
    assert big.beyond.startswith("beyond the evidence") and \
        "evidence reaches B = 64, length 12288 samples; the 70B run at B = 1024 is beyond it" in big.beyond
    long = interpolate(pts, 64, 10 ** 8)
    assert long.value == pytest.approx(0.1) and "beyond the longest measured run" in long.beyond
    small = interpolate(pts, 8, 3072)
    assert small.value == pytest.approx(1.3) and "below it" in small.beyond
    unknown = interpolate(pts, 64, None)  # no length given: the longest measured at that B
    assert unknown.value == pytest.approx(0.1) and "no run length given" in unknown.note
    assert interpolate(pts, 32, 3072, "factor").value == pytest.approx(1.09)


def test_only_qualifying_rows_of_the_modes_own_count(tmp_path):
    """A grid point, like a benchmark row, counts from 3 seeds; a mode with fewer is "not measured"."""
    grid = tmp_path / "loss_grid"
    grid.mkdir()
    runs = []
    for mode, losses in (("torch-ddp", (2.0, 2.1, 2.2)), ("zero1+loco4", (2.02, 2.1, 2.2))):
        for seed, final in enumerate(losses):
            evals = [{"samples": 100, "loss": 3.0}, {"samples": 200, "loss": final}]
            runs.append({"mode": mode, "lr": 1e-3, "seed": seed, "final_loss": final, "evals": evals})
    summary = {"torch-ddp": {"best_lr": 1e-3, "gap_vs_ddp_pct": {"0": 0.0, "1": 0.0, "2": 0.0}},
               "zero1+loco4": {"best_lr": 1e-3, "gap_vs_ddp_pct": {"0": 1.0, "1": 0.0}}}
    doc = {"global_batch": 32, "samples": 200, "workload": {}, "runs": runs, "summary": summary}
    (grid / "b32_n200.json").write_text(json.dumps(doc))
    two_seeds = estimate(Mode("zero1", "loco4", "int8"), tmp_path, 32, 200)
    assert not two_seeds.measured and "2 seeds < 3" in two_seeds.not_measured()
    summary["zero1+loco4"]["gap_vs_ddp_pct"]["2"] = 0.6
    (grid / "b32_n200.json").write_text(json.dumps(doc))
    all_points.cache_clear()
    from engine.planner.quality import results_doc

    results_doc.cache_clear()
    three = estimate(Mode("zero1", "loco4", "int8"), tmp_path, 32, 200)
    # the median over the seeds
    assert three.measured and three.value == pytest.approx(0.6) and three.basis[0].factor is not None
    # the int4 variant has no rows of its own: nothing is carried over from int8's
    assert not estimate(Mode("zero1", "loco4", "int4"), tmp_path, 32, 200).measured


def test_goal_is_one_setting_with_clear_errors():
    assert Goal().kind == EngineConfig().auto_goal == "loss_per_sample"
    assert Goal().loss_bound_pct == EngineConfig().auto_loss_bound_pct == 0.5
    with pytest.raises(ValueError, match="choose one of"):
        Goal("fastest")
    with pytest.raises(ValueError, match="percentage"):
        Goal("loss_per_sample", -1)
    with pytest.raises(ValueError, match="auto_goal"):
        EngineConfig(strategy="auto", auto_goal="fastest").validate()


def test_muon_runs_stand_on_muon_rows_against_ddp_with_muon():
    """With optimizer='muon' every loss figure comes from the Muon JSONs (torch DDP + Muon the
    reference) and an AdamW row never stands in; the AdamW figures do not move."""
    acco = Mode("acco")
    muon = estimate(acco, RESULTS, 16, 3072, optimizer="muon")
    doc = json.loads((RESULTS / "muon_protocol_1gbit_b16_3seeds.json").read_text())
    row = next(o for o in doc["modes"] if o["mode"] == "acco")
    assert muon.measured and muon.value == pytest.approx(row["loss_vs_ref_pct"])
    assert {p.source for p in muon.basis} == {"muon_protocol_1gbit_b16_3seeds.json"}
    adamw = estimate(acco, RESULTS, 16, 3072)
    assert adamw.measured and all(p.optimizer == "adamw" for p in adamw.basis) and adamw.value != muon.value
    # a mode with AdamW rows only is not measured under Muon, nor one whose Muon row has one seed (acco+loco4)
    for mode in (Mode("zero1", "loco4", "int4"), Mode("acco", "loco4", "int8")):
        assert estimate(mode, RESULTS, 16, 3072).measured
        assert not estimate(mode, RESULTS, 16, 3072, optimizer="muon").measured
    plan = make_plan(PRESETS["1b"], Layout(2, 1), gpu(1, mfu=MFU), Batch(16, 1), results=RESULTS,
                     goal=Goal(optimizer="muon"))
    assert "keep Muon's loss per sample" in plan.why and "AdamW" not in plan.why
    with pytest.raises(ValueError, match="optimizer 'lion'"):
        Goal(optimizer="lion")
    cfg = EngineConfig(strategy="auto", optimizer="muon", global_micro_batches=16)
    _, decision, _ = decide_auto(cfg, PRESETS["1b"], Layout(2, 1), gpu(1, mfu=MFU), WireSettings(), RESULTS, None,
                                 batch=Batch(16, 1))
    assert decision.goal.optimizer == "muon"


def test_auto_modes_follow_the_config():
    two = Layout(2, 8)
    modes = auto_modes(EngineConfig(strategy="auto"), two)
    assert modes and all(m.exchange == "two-level" and m.sharding == "none" for m in modes)
    assert {m.strategy for m in modes} == {"zero1", "acco"}  # never dpu, local steps or 1-bit Adam
    flat = auto_modes(EngineConfig(strategy="auto", topology="flat", codec="loco4", param_codec="int4"), two)
    assert {(m.exchange, m.codec, m.param_codec) for m in flat} == {("flat", "loco4", "int4")}


def test_the_planner_cli_takes_the_goal_and_prints_the_evidence(tmp_path, capsys):
    from engine.plan import main

    out = tmp_path / "plan.json"
    args = ["--model", "70b", "--nodes", "8", "--gpus-per-node", "8", "--inter-gbit", "10", "--global-batch", "1024",
            "--micro-batch", "1", "--results", str(RESULTS)]
    assert main(args + ["--goal", "time_to_loss", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Recommended: Goal: reach AdamW's loss soonest" in text
    assert "evidence reaches B = 256, length 12288 samples; the 70.6B run at B = 1024 is beyond it" in text
    doc = json.loads(out.read_text())
    assert doc["goal"] == {"kind": "time_to_loss", "loss_bound_pct": 0.5, "optimizer": "adamw"}
    rec = next(r for r in doc["rows"] if r["mode"] == doc["recommended"])
    assert rec["samples_to_adamw_loss"] is not None and rec["loss_evidence"].startswith("B 256")
    assert any(r["loss_not_measured"].startswith("not measured") for r in doc["rows"])
    with pytest.raises(SystemExit, match="percentage"):
        main(args + ["--loss-bound", "-1"])
