"""The planner (engine/planner, `python -m engine.plan`): its byte counts against the engine's own
counters and the benchmark JSONs, its step times against the testbed's measurements
(benchmarks/plan_validate.py), memory, the recommendation and the command line."""

from __future__ import annotations

import statistics

import pytest
import torch

import benchmarks.node_bytes as nb
from benchmarks import plan_validate as validate
from benchmarks.plan_validate import RESULTS
from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from engine.parallel.topology import Layout
from engine.planner.hardware import TESTBED_CONSTANTS, cpu_testbed, gpu
from engine.planner.memory import memory_per_gpu
from engine.planner.modes import Mode
from engine.planner.recommend import make_plan
from engine.planner.shape import PRESETS, from_shape, from_transformers
from engine.planner.timeline import Batch, step_time
from engine.planner.wire import WireSettings, step_bytes
from tests.tiny import mse_loss, worker_stream


def test_testbed_bytes_match_the_benchmark_counters_exactly():
    rows = validate.rows()
    assert len(rows) >= 12
    for r in rows:
        assert r.predicted_bytes == pytest.approx(r.measured_bytes, rel=0, abs=1e-6), (r.file, r.mode)


def test_testbed_step_times_within_the_stated_bounds():
    rows = validate.rows()
    s = validate.summary(rows)
    assert s["rows"] >= 12 and s["clean_rows"] >= 12
    assert s["median_abs_error"] <= 0.10, validate.table(rows)
    # files whose compute-only pace moved by > 1.3x during them ran beside other load; outside
    # them the largest miss is torch DDP at 1 Gbit/s in sweep_1gbit_b16 (0.877 s, where the 3-seed
    # file measured 0.638 s for the same configuration at the same pace): 25.9%, over the 25%
    assert s["clean_max_abs_error"] <= 0.27, validate.table(rows)
    assert s["max_abs_error"] <= 0.40, validate.table(rows)  # the loaded file: docs/planning.md
    # the engine rows alone (DDP's rows calibrate the link efficiency)
    assert s["engine_rows"] >= 12 and s["engine_median_abs_error"] <= 0.10
    assert s["engine_clean_max_abs_error"] <= 0.25
    # the layouts and links the issue asks for are all there
    assert {r.layout for r in rows} >= {"2x1", "3x1 hetero"}
    assert {r.rate for r in rows} >= {"20mbit", "100mbit", "1gbit"}


def test_stated_testbed_constants_are_the_jsons():
    got = validate.measure_constants()
    for key, value in got.items():
        name, _, sub = key.partition(".")
        stated = TESTBED_CONSTANTS[name]
        if sub:
            stated = stated[float(validate.parse_rate(sub)) if name == "link_efficiency" else sub]
        assert stated == pytest.approx(value, rel=0.05), key


def _engine_bytes(rank, world, settings):
    out = {}
    for name, kw in settings.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 700), torch.nn.Tanh(), torch.nn.Linear(700, 3))
        cfg = EngineConfig(lr=1e-3, micro_batches=1, accumulation="fixed", max_steps=4, **kw)
        engine = Engine(model, cfg, mse_loss)
        hist = engine.fit(iter(worker_stream(rank, 50)))
        engine.close()
        out[name] = [h["wire_bytes"] for h in hist]
    return out


MODES_TO_COUNT = {"zero1": Mode("zero1"), "acco+loco4+int4params": Mode("acco", "loco4", "int4"),
                  "acco+loco4+int8params": Mode("acco", "loco4", "int8"), "dpu": Mode("dpu")}


def test_planner_bytes_equal_the_engine_counters_world2():
    settings = {k: m.engine_settings() for k, m in MODES_TO_COUNT.items()}
    got = spawn(_engine_bytes, 2, settings)[0]
    numel = 6 * 700 + 700 + 700 * 3 + 3
    for name, mode in MODES_TO_COUNT.items():
        want = step_bytes(numel, Layout(2, 1), mode, WireSettings()).rank
        assert got[name][-1] == want, (name, got[name], want)


def test_two_level_divides_the_node_link_bytes_by_g():
    # the testbed's formula carries gradients and parameters in one dtype: bf16 gradient buffers
    numel, ws = 10_000_000, WireSettings(compute_bytes=2, grad_dtype="compute")
    for m in (2, 8, 64):
        layout = Layout(m, 8)
        for mode, name in ((Mode("zero1"), "zero1"), (Mode("acco", "loco4", "int4"), "acco+loco4+int4params")):
            flat = step_bytes(numel, layout, mode, ws).node_link
            two = step_bytes(numel, layout, Mode(mode.strategy, mode.codec, mode.param_codec, "two-level"), ws).node_link
            # the testbed's physical per-link formula (its node counters check it): the flat
            # all-to-all is G x the rail's, the flat ring all-gather about 2x the rail's
            ratio = nb.node_link_bytes_over_s(f"{name}@flat", m, 8) / nb.node_link_bytes_over_s(f"{name}@two_level", m, 8)
            assert flat / two == pytest.approx(ratio, rel=0.02), (m, mode)
            assert 4 < flat / two < 8
        # the ring crosses each node boundary once: 2 (N-1)/N P e, whatever G is
        ddp = step_bytes(numel, layout, Mode("torch-ddp", ddp_dtype="bfloat16"), ws).node_link
        assert ddp == pytest.approx(2 * (m * 8 - 1) / (m * 8) * numel * 2, rel=1e-6)
    # issue 22's figure: acco + loco4 + int4 params two-level at M = 2 sends ~0.27 S per step (S = fp32 grad bytes)
    two = step_bytes(numel, Layout(2, 8), Mode("acco", "loco4", "int4", "two-level"), WireSettings()).node_link
    assert two / (4 * numel) == pytest.approx(0.266, abs=0.01)


def test_overlap_hides_the_link_only_for_overlapping_strategies():
    shape = from_shape(6, 256, 257, params=4_837_888, seq_len=128)
    hw = cpu_testbed(100e6, 17.0)
    batch = Batch(16, 8)
    zero1 = step_time(Mode("zero1"), shape, Layout(2), hw, batch)
    dpu = step_time(Mode("dpu"), shape, Layout(2), hw, batch)
    acco = step_time(Mode("acco"), shape, Layout(2), hw, batch)
    # zero1 pays compute + round; dpu hides the round behind one step's compute; acco sends twice
    assert zero1.step_s == pytest.approx(zero1.compute_s + zero1.inter_s + zero1.comm_work_s - 0.0, rel=0.15)
    assert dpu.step_s < zero1.step_s
    assert acco.bytes.rank == 2 * zero1.bytes.rank


def test_memory_follows_the_layouts_of_design_3_1():
    shape = PRESETS["8b"]
    ws = WireSettings(compute_bytes=2)
    layout = Layout(8, 8)
    zero1 = memory_per_gpu(Mode("zero1"), shape, layout, ws)
    acco = memory_per_gpu(Mode("acco", "loco4", "int4"), shape, layout, ws)
    acco2 = memory_per_gpu(Mode("acco", "loco4", "int4", "two-level"), shape, layout, ws)
    ddp = memory_per_gpu(Mode("torch-ddp"), shape, layout, ws)
    # 3e (uncompressed: grad_dtype auto keeps bf16 gradient buffers; the round gathers into the one it
    # reduced), master + moments (step_copy auto on a GPU: a few pieces of scratch, no spare), the
    # reducer's output, the master's piece cast to bf16 (plus NCCL's one fp32 piece of the
    # reduce-scatter: a constant, engine/planner/memory.py)
    assert zero1.total == pytest.approx(shape.params * (6 + (12 + 4 + 2) / 64), rel=3e-3)  # (the cast: 2 pieces, not 2/64)
    whole = memory_per_gpu(Mode("zero1"), shape, layout, WireSettings(compute_bytes=2, step_copy="whole"))
    # the spare, less the scratch (20 bytes a value of one piece of 2^24 / 64 values: 5 MB)
    assert whole.optimizer - zero1.optimizer == pytest.approx(12 * shape.params / 64 - 20 * 2**24 / 64, rel=1e-3)
    fp32 = memory_per_gpu(Mode("zero1"), shape, layout, WireSettings(compute_bytes=2, grad_dtype="float32"))
    assert fp32.total - zero1.total == pytest.approx(4 * shape.params, rel=1e-3)  # two buffers, 2 bytes more each
    codec_fp32 = memory_per_gpu(Mode("zero1", "loco4"), shape, layout, ws)  # auto: fp32 under a codec
    codec_bf16 = memory_per_gpu(Mode("zero1", "loco4"), shape, layout, WireSettings(compute_bytes=2, grad_dtype="compute"))
    assert codec_fp32.total - codec_bf16.total == pytest.approx(4 * shape.params, rel=1e-3)
    # the int8 error and its group scales (error_after_skip auto on a GPU: reset, no rollback copy)
    assert acco.codec_state == pytest.approx(shape.params * (1 + 4 / 128))
    rollback = memory_per_gpu(Mode("acco", "loco4", "int4"), shape, layout,
                              WireSettings(compute_bytes=2, error_after_skip="rollback"))
    assert rollback.codec_state == pytest.approx(2 * acco.codec_state)
    assert acco2.codec_state == pytest.approx(acco.codec_state / 8)  # error feedback on the rank's slice
    assert ddp.total == 16 * shape.params
    # 40 bytes a value, and the inner step's piece scratch (4 MiB)
    assert memory_per_gpu(Mode("diloco"), shape, layout, WireSettings()).total == 40 * shape.params + 4 * 2**20


def test_shape_from_a_transformers_config_counts_exactly():
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=257, n_positions=129, n_embd=256, n_layer=6, n_head=8)
    shape = from_transformers(cfg, seq_len=128)
    assert shape.params == validate.testbed_shape({"n_layer": 6, "n_embd": 256, "seq_len": 128}).params == 4_837_888


def test_recommendation_keeps_adamw_and_follows_the_link():
    from engine.planner.goal import Goal

    shape = from_shape(6, 256, 257, params=4_837_888, seq_len=128)
    batch = Batch(16, 4)
    slow = make_plan(shape, Layout(2), cpu_testbed(20e6, 17.0), batch, WireSettings(), results=RESULTS)
    # zero1 with LoCo-4 has rows of its own in the loss grid (3 seeds, within the bound at its longest
    # run, 12288 samples: median +0.47% with int8 deltas; int4 deltas +0.65%, above it) and is the fastest
    # on a slow link that keeps AdamW's loss; acco + LoCo-4 + int4 deltas is measured there too (+0.46%)
    # but slower
    assert slow.choice.mode.strategy == "zero1" and slow.choice.mode.codec == "loco4", slow.why
    assert slow.choice.loss.measured and slow.choice.loss.value <= 0.5
    assert all(p.source.startswith("loss_grid/") and len(p.seeds) >= 3 for p in slow.choice.loss.basis)
    acco = next(r for r in slow.rows if r.mode == Mode("acco", "loco4", "int4"))
    assert acco.loss.measured and acco.loss.value <= 0.5 and acco.time.step_s > slow.choice.time.step_s
    # every faster mode of the same exchange was left out for a measured reason or for want of rows
    for r in slow.rows:
        if r.time.step_s < slow.choice.time.step_s and r.mode.exchange == slow.choice.mode.exchange and r.fits:
            assert not r.loss.measured or r.loss.value > 0.5 or not r.adamw_class, r.mode.name
    # reaching AdamW's loss soonest: the same 4-bit exchange, by its measured samples factor
    soon = make_plan(shape, Layout(2), cpu_testbed(20e6, 17.0), batch, WireSettings(), results=RESULTS,
                     goal=Goal("time_to_loss"))
    assert soon.choice.mode.codec == "loco4" and soon.choice.factor.measured, soon.why
    # on an H100 pair with 400 Gbit/s between them, nothing is worth a lossy codec
    fast = make_plan(PRESETS["1b"], Layout(2, 1), gpu(400), Batch(64, 4), WireSettings(compute_bytes=2),
                     results=RESULTS)
    assert fast.choice.mode.codec == "none" and fast.choice.mode.param_codec == "auto", fast.why
    assert fast.choice.time.step_s <= min(r.time.step_s for r in fast.rows if r.adamw_class) * 1.03


def test_cli_prints_a_plan_and_a_reason(capsys, tmp_path):
    from engine.plan import main

    out_json = tmp_path / "plan.json"
    assert main(["--model", "1b", "--nodes", "2", "--gpus-per-node", "8", "--inter-gbit", "10",
                 "--global-batch", "256", "--micro-batch", "2", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "Recommended: Goal: keep AdamW's loss per sample" in text and "[2-level]" in text
    assert "Soonest to AdamW's loss (any measured mode" in text
    import json

    doc = json.loads(out_json.read_text())
    assert doc["recommended"] and len(doc["rows"]) >= 20
    soonest = next(r for r in doc["rows"] if r["mode"] == doc["soonest"])
    # the soonest, or within 3% of it the simplest
    assert soonest["to_loss_vs_ddp"] <= 1.03 * min(r["to_loss_vs_ddp"] for r in doc["rows"] if r["to_loss_vs_ddp"])
    assert statistics.median(r["step_s"] for r in doc["rows"]) > 0


def test_cli_refuses_a_count_without_a_shape():
    from engine.plan import main

    with pytest.raises(SystemExit, match="--layers"):
        main(["--params", "1000000"])


def _probe_and_plan(rank, world):
    from engine.planner.hardware import cpu_testbed
    from engine.planner.probe import probe_cluster
    from tests.tiny import tiny_model

    shape = from_shape(2, 16, 3, params=6 * 16 + 16 + 16 * 3 + 3, seq_len=1)
    measured = probe_cluster(shape, micro_batch=4, model=tiny_model(), payload=2**20, repeats=2)
    plan = make_plan(shape, Layout(measured.nodes, measured.per_node),
                     cpu_testbed(measured.inter_Bps * 8, measured.samples_per_s), Batch(16, 4), WireSettings(),
                     results=RESULTS)
    return measured, plan.choice.mode.name, plan.choice.time.step_s


def test_measure_probes_two_gloo_processes_and_feeds_the_plan():
    results = spawn(_probe_and_plan, 2)
    (m0, choice0, step0), (m1, choice1, step1) = results
    assert m0.nodes == 2 and m0.per_node == 1
    # loopback between two processes: far above a shaped link, far below a terabyte per second
    assert 1e7 < m0.inter_Bps < 1e12, m0
    assert 10 < m0.samples_per_s < 1e8, m0
    # every rank takes the slowest rank's figures, so every rank plans the same
    assert (m0.inter_Bps, m0.samples_per_s) == (m1.inter_Bps, m1.samples_per_s)
    assert choice0 == choice1 and step0 == step1 > 0


def test_cli_reads_a_transformers_config_folder(tmp_path, capsys):
    from transformers import GPT2Config

    from engine.plan import main

    GPT2Config(vocab_size=257, n_positions=129, n_embd=256, n_layer=6, n_head=8).save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--nodes", "2", "--inter-gbit", "0.1", "--cpu-testbed",
                 "--samples-per-s", "17", "--global-batch", "16", "--micro-batch", "4",
                 "--compute-dtype", "float32", "--flat-only"]) == 0
    text = capsys.readouterr().out
    assert "0.00484B parameters" in text and "[2-level]" not in text
    with pytest.raises(SystemExit, match="no transformers config"):
        main(["--model", str(tmp_path / "missing")])


def test_loss_per_sample_comes_from_the_measured_tables():
    from engine.planner.evidence import estimate

    acco = estimate(Mode("acco", "loco4", "int4"), RESULTS, 16, 3072)
    # acco_headline_100mbit_b16_3seeds.json (3 seeds, +1.35%) at B = 16 and 3072 samples; the loss grid's
    # point there has 2 seeds (+0.93%): shown, not counted
    sources = {p.source for p in acco.basis}
    assert sources == {"acco_headline_100mbit_b16_3seeds.json"}, sources
    assert acco.value == pytest.approx(1.348, abs=1e-3) and not acco.beyond
    assert "loss_grid/b16_n3072.json" in {p.source for p in acco.unqualified}
    assert estimate(Mode("sparseloco"), RESULTS, 16, None).value > 10  # +16-18% per sample at H = 15
    # zero1 with LoCo stands on its own rows (the grid's zero1+loco4), never on acco's
    assert {p.bench for p in estimate(Mode("zero1", "loco4", "int8"), RESULTS, 16, None).basis} == {"zero1+loco4"}
    dpu = estimate(Mode("dpu"), RESULTS, 16, None)  # one seed: shown, not enough
    assert not dpu.measured and "acco_attribution_1gbit_b16_s0.json 1 seed < 3" in dpu.not_measured()
    # no results folder: nothing measured, and it says so (the planner never finds one by itself)
    assert not estimate(Mode("acco", "loco4", "int4"), None, 16, None).measured


def _curve(samples_per_eval, losses, s_per_sample=1.0):
    return [{"samples": samples_per_eval * (i + 1), "time_s": s_per_sample * samples_per_eval * (i + 1),
             "step": i + 1, "loss": x} for i, x in enumerate(losses)]


def test_samples_to_adamw_loss_per_run():
    from engine.planner.quality import first_crossing, run_factor

    ddp = {"evals": _curve(100, [4.0, 3.0, 2.5, 2.0]), "final_loss": 2.0}
    assert first_crossing(ddp["evals"], 2.75) == pytest.approx(250)  # linear between 200 and 300
    assert first_crossing(ddp["evals"], 1.0) is None
    same = {"evals": _curve(100, [4.0, 3.0, 2.5, 2.0]), "final_loss": 2.0}
    assert run_factor(same, ddp) == (pytest.approx(1.0), "reached")
    slow = {"evals": _curve(200, [4.0, 3.0, 2.5, 2.0]), "final_loss": 2.0}  # the same curve at twice the samples
    assert run_factor(slow, ddp) == (pytest.approx(2.0), "reached")
    # ends short of DDP's last point: its 400 samples were worth the 250 at which DDP had 2.75
    short = {"evals": _curve(100, [4.0, 3.5, 3.0, 2.75]), "final_loss": 2.75}
    assert run_factor(short, ddp) == (pytest.approx(400 / 250), "equivalent")


def test_samples_factor_comes_from_the_measured_runs():
    from engine.planner.evidence import estimate, warmup_fraction

    def factor(mode, b=16, n=None):
        return estimate(mode, RESULTS, b, n, "factor")

    assert factor(Mode("torch-ddp")).value == 1.0
    assert not factor(Mode("torch-ddp", ddp_dtype="bfloat16")).measured  # never measured
    acco = factor(Mode("acco", "loco4", "int4"), 16, 3072)
    assert 1.0 < acco.value < 1.4, acco.sources()  # 1.18x AdamW's samples at B = 16, 3072 samples
    longer = factor(Mode("acco", "loco4", "int4"))  # the longest measured at B = 16: the grid's 12288
    assert longer.measured and all(p.samples == 12288 for p in longer.basis) and 0.9 < longer.value < 1.1
    assert factor(Mode("zero1"), 96, 3072).value == pytest.approx(1.0, abs=0.02)
    sparse = factor(Mode("sparseloco"))
    assert 1.7 < sparse.value < 2.4  # twice AdamW's samples at H = 15
    assert not factor(Mode("onebit_adam")).measured  # 1-bit Adam's 3-seed file compared one seed with DDP
    assert warmup_fraction(factor(Mode("acco"))) is None
    assert not factor(Mode("dpu")).measured


def test_samples_factor_at_the_runs_length():
    from engine.planner.evidence import estimate

    acco = Mode("acco", "loco4", "int4")
    # the 96-step runs (1536 samples) have 1-2 seeds: the figure stands on the 3072-sample runs and says so
    short = estimate(acco, RESULTS, 16, 1536, "factor")
    assert short.measured and "short of the shortest measured run there (3072)" in short.beyond
    assert all(p.samples == 3072 for p in short.basis)
    assert estimate(acco, RESULTS, 16, 3072, "factor").beyond == ""


def test_rows_scored_on_another_held_out_set_are_left_out():
    from engine.planner.quality import scored_like_ddp

    before = {"config": {"micro_batch": 8}}
    assert scored_like_ddp(before, {"micro_batch": 8})
    assert not scored_like_ddp(before, {"micro_batch": 4})  # ACCO at half DDP's, before the fix
    assert scored_like_ddp({"config": {"micro_batch": 8, "eval_micro_batch": 8}}, {"micro_batch": 4})


def test_time_to_loss_charges_the_onebit_warmup_at_the_uncompressed_round():
    from engine.planner.decide import time_to_loss

    assert time_to_loss(2.0, 1.5) == pytest.approx(3.0)
    # 20% of AdamW's steps at 10 s (warmup), the other 0.6 at 1 s
    assert time_to_loss(1.0, 0.8, 0.2, 10.0) == pytest.approx(2.0 + 0.6)


def _testbed_plan(gbit):
    shape = validate.gpt2_shape({"n_layer": 6, "n_embd": 256, "seq_len": 128})
    return make_plan(shape, Layout(2, 1), cpu_testbed(gbit * 1e9, 25.0), Batch(16, 8),
                     WireSettings(compute_bytes=4), modes=None, results=RESULTS)


def test_soonest_to_adamw_loss_weighs_step_time_against_samples():
    slow = _testbed_plan(0.02)
    # 20 Mbit/s: sparseloco's wire is ~0 and its 2x samples cost less than anything's wire
    assert slow.soonest.mode.name == "sparseloco-h15", slow.why_soonest
    assert "is not AdamW's" in slow.why_soonest
    assert slow.choice.adamw_class  # the AdamW-class recommendation stays one
    ranked = sorted((r for r in slow.rows if r.to_loss_vs_ddp is not None), key=lambda r: r.to_loss_vs_ddp)
    assert ranked[0] is slow.soonest
    fast = _testbed_plan(100)
    # a link 100x faster than the compute needs: twice the samples is twice the time
    assert fast.soonest.factor.value < 1.2, fast.why_soonest
    sparse = next(r for r in fast.rows if r.mode.name == "sparseloco-h15")
    assert sparse.to_loss_vs_ddp > 1.5


def test_planner_node_link_bytes_match_the_testbed_node_counters():
    """Every node-layout run of the testbed (2 x 2, 2 x 4, 2 x 8; flat and two-level; DDP, zero1,
    acco, sparseloco): the planner's payload through node 0's link against the veth's tx counter,
    which adds TCP/IP framing (~0.6 kB a message: a few percent on large messages, up to 30% on
    acco's many small compressed chunks at 2 x 8, most of sparseloco's few-kB steps)."""
    rows = validate.node_link_rows()
    assert len(rows) >= 20 and {r[2] for r in rows} >= {"2x2", "2x4", "2x8"}
    for name, mode, lay, pred, meas in rows:
        assert meas >= pred, (name, mode, lay)  # the counter never sees less than the payload
        if pred > 100_000:
            assert meas / pred < 1.31, (name, mode, lay, meas / pred)
