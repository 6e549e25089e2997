"""The benchmark's matched-batch protocol without a testbed: the global batch B -> each mode's
micro-batch, DDP accumulation and engine global micro-batches; bad B refused with a clear
message; the worker's configs under both protocols; one lr schedule for every mode (the engine's
lr_at, DDP's torch scheduler and a real engine's recorded lrs agree exactly); the report's new
fields (loss at equal samples against DDP, time to target and its spread, overlap efficiency at
each mode's micro-batch) on made-up runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from acco_loco.schedule import lr_at
from benchmarks.modes import BENCHMARK_MODES, DEFAULT_MODES, MODES, BatchError, matched_batch, matched_schedule
from benchmarks.report import aggregate, loss_at_samples, verdict
from benchmarks.runner import eval_points, runs_for_seed, train_spec, write_outputs
from benchmarks.worker import SharedLR, engine_config
from recipes.benchmark import main, parse_args


# ------------------------------------------------------------------ B -> each mode's batch
@pytest.mark.parametrize("b, workers, expect", [
    # mode: (micro-batch, DDP accumulation or engine micro-batches per step)
    (16, 2, {"torch-ddp": (8, 1), "torch-ddp+powersgd4": (8, 1), "zero1": (8, 2), "dpu": (8, 2),
             "acco": (4, 4), "acco+loco4+int4params": (4, 4)}),
    (64, 2, {"torch-ddp": (8, 4), "torch-ddp+powersgd4": (8, 4), "zero1": (8, 8), "dpu": (8, 8),
             "acco": (8, 8), "acco+loco4+int4params": (8, 8)}),
    (48, 3, {"torch-ddp": (8, 2), "zero1": (8, 6), "acco": (8, 6)}),
    (24, 3, {"torch-ddp": (8, 1), "zero1": (8, 3), "acco": (4, 6)}),
])
def test_global_batch_maps_to_each_modes_micro_batches(b, workers, expect):
    for name, (mb, count) in expect.items():
        plan = matched_batch(name, b, workers, 8)
        assert plan.micro_batch == mb and plan.samples_per_step == b
        if MODES[name].kind == "torch-ddp":
            assert plan.accumulation == count and plan.global_micro_batches is None
            assert mb * count * workers == b
        else:
            assert plan.global_micro_batches == count and plan.accumulation is None
            assert mb * count == b
            # every worker runs the same whole number of micro-batches in every round: each reads
            # B / workers samples per step, as DDP's worker does
            assert plan.per_worker_round >= 1
            assert plan.per_worker_round * plan.rounds_per_step * workers == count
    assert matched_batch("acco", 64, 2, 8).per_worker_round == 2  # 2 rounds x 2 workers x 2 x 8


def test_the_command_line_plans_every_mode_and_the_budget():
    a = parse_args(["--global-batch", "64"])
    assert a.protocol == "matched" and a.modes == list(DEFAULT_MODES["matched", False])
    assert a.samples == 3072 and a.steps == 48 and a.seeds == 3
    assert a.lr_sweep and a.sweep_seeds == 1 and a.lrs == [5e-4, 1e-3, 2e-3] and a.max_grad_norm == 1.0
    assert {m: p.describe() for m, p in a.batch_plans.items()}["acco+loco4+int4params"] == "8 x 8/step (2 rounds)"
    b16 = parse_args([])
    assert b16.global_batch == 16 and b16.steps == 192
    assert b16.batch_plans["acco"].describe() == "4 x 4/step (2 rounds)"
    assert b16.batch_plans["torch-ddp"].describe() == "8 x acc 1"
    assert parse_args(["--steps", "10", "--global-batch", "64"]).samples == 640
    free = parse_args(["--protocol", "free"])
    assert free.modes == list(DEFAULT_MODES["free", False]) and free.samples == 1536 and not free.lr_sweep
    assert free.max_micro_batches == 4 and free.reference == "torch-ddp-acc1" and b16.reference == "torch-ddp"


def test_bad_global_batches_are_refused_clearly(capsys):
    with pytest.raises(BatchError, match="choose a multiple of 16"):
        matched_batch("torch-ddp", 12, 2, 8)
    with pytest.raises(BatchError, match="positive number of samples"):
        matched_batch("zero1", 0, 2, 8)
    with pytest.raises(BatchError, match="must be a multiple of 4"):
        matched_batch("acco", 6, 2, 8)  # 2 rounds x 2 workers
    with pytest.raises(BatchError, match="free-batch protocol only"):
        matched_batch("acco+loco4+int4params+cap1", 16, 2, 8)
    with pytest.raises(BatchError, match="free-batch protocol only"):
        matched_batch("torch-ddp-acc4", 64, 2, 8)
    for argv, message in [
        (["--global-batch", "12"], "choose a multiple of 16"),
        (["--global-batch", "0"], "positive number of samples"),
        (["--hetero"], "choose a multiple of 24"),  # 3 workers x micro-batch 8
        (["--global-batch", "64", "--samples", "3000"], "use 2944 or 3008"),
        (["--global-batch", "64", "--samples", "32"], "use 64"),
        (["--protocol", "free", "--global-batch", "16"], "--global-batch sets the matched-batch"),
        (["--protocol", "free", "--balance", "speed"], "--balance sets the matched-batch"),
        (["--max-micro-batches", "2"], "--max-micro-batches tunes the free protocol"),
        (["--modes", "torch-ddp,acco+loco4+int4params+cap1"], "free protocol only"),
        (["--modes", "torch-ddp-acc1"], "free protocol only"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err, argv


# ------------------------------------------------------------------ what the workers are told
def test_every_mode_gets_a_valid_config_under_each_protocol_it_allows():
    from engine import EngineConfig

    # <mode>@flat / @two_level only where the engine has the topology setting (the recipe
    # refuses them otherwise: tests/benchmarks/test_nodes.py)
    topology = "topology" in EngineConfig.field_names()
    for protocol in ("matched", "free"):
        modes = [m for m in BENCHMARK_MODES if protocol in MODES[m].protocols and (topology or "@" not in m)]
        args = parse_args(["--protocol", protocol, "--modes", ",".join(modes)])
        points = eval_points(args)
        for m in modes:
            plan, spec = args.batch_plans[m], train_spec(args, m, 2e-3, 1)
            steps = args.steps
            if MODES[m].local_steps:
                # whole outer periods: 192 inner steps -> 195 at H = 15, 200 at H = 50
                period = MODES[m].extra["inner_steps"]
                steps = -(-192 // period) * period
                assert spec["samples"] == 16 * steps and steps % period == 0 and 192 <= steps < 192 + period
                # the budget's points, then on at the same spacing, the end included
                assert spec["eval_points"][:len(points)] == points and spec["eval_points"][-1] == 16 * steps
            else:
                assert spec["eval_points"] == points and spec["samples"] == args.samples
            assert spec["micro_batch"] == plan.micro_batch
            if MODES[m].kind == "torch-ddp":
                assert spec["accumulation"] == plan.accumulation
                continue
            cfg = engine_config(spec)  # EngineConfig validates its rules between fields
            assert cfg.max_grad_norm == 1.0 and cfg.strategy == MODES[m].strategy
            if protocol == "matched":
                assert cfg.accumulation == "fixed" and cfg.global_micro_batches == plan.global_micro_batches
                assert cfg.max_micro_batches is None and cfg.micro_batches == 1
                assert (cfg.lr, cfg.lr_schedule, cfg.min_lr_ratio) == (2e-3, "cosine", 0.1)
                assert cfg.max_steps == steps and cfg.warmup_steps == round(0.05 * steps)
            else:
                assert cfg.accumulation == "grow" and cfg.global_micro_batches is None
                assert cfg.max_micro_batches == (1 if m.split("@")[0].endswith("+cap1") else 4)
                assert cfg.lr_schedule == "constant" and cfg.lr == 2e-3
    # matched batch: the eval points are whole steps, the same samples for every mode
    assert eval_points(parse_args(["--global-batch", "64", "--eval-points", "5"])) == [640, 1216, 1856, 2432, 3072]
    # a local-step mode's budget: K x the samples, in whole outer periods
    local = parse_args(["--modes", "torch-ddp,sparseloco-h50", "--samples", "1536", "--local-samples-factor", "4"])
    spec = train_spec(local, "sparseloco-h50", 1e-3, 0)
    assert spec["samples"] == 16 * 400 and spec["lr_schedule"]["total_steps"] == 400  # 384 -> 8 periods of 50
    assert train_spec(local, "torch-ddp", 1e-3, 0)["samples"] == 1536


# ------------------------------------------------------------------ one lr schedule
def test_the_shared_lr_schedule_is_the_engines_lr_at_at_every_step():
    steps, lr = 192, 1e-3
    sched = matched_schedule(lr, steps)
    assert (sched.warmup_steps, sched.kind, sched.min_lr_ratio, sched.total_steps) == (10, "cosine", 0.1, 192)
    want = [lr_at(s, lr, "cosine", 10, steps, 0.1) for s in range(steps)]
    assert [sched.at(s) for s in range(steps)] == want
    assert want[0] == pytest.approx(lr / 11) and want[9] == pytest.approx(lr * 10 / 11)
    assert want[10] == lr and want[-1] == pytest.approx(0.1 * lr, rel=1e-3)
    # the engine, configured as the worker configures it, computes the same
    args = parse_args(["--modes", "acco"])
    cfg = engine_config(train_spec(args, "acco", lr, 0))
    assert [lr_at(s, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
            for s in range(steps)] == want
    # torch DDP's scheduler: the lr each optimizer step runs at, number for number
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=lr)
    ddp_sched = SharedLR(opt, sched)
    got = []
    for _ in range(steps):
        got.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3)
        opt.step()
        ddp_sched.step()
    assert got == want
    assert matched_schedule(lr, 48).warmup_steps == 2 and matched_schedule(lr, 4).warmup_steps == 1


def test_a_real_engine_records_the_lrs_that_ddp_runs_at():
    """World 1, a tiny model: the engine under the matched config follows the schedule DDP's
    scheduler gives, step for step (the lr it recorded in its history)."""
    from engine import Engine
    from tests.tiny import mse_loss, tiny_model, worker_stream

    args = parse_args(["--modes", "acco,zero1", "--samples", "160", "--micro-batch", "4", "--global-batch", "16"])
    for mode in args.modes:
        spec = train_spec(args, mode, 1e-2, 0)
        spec["comm_chunks"], spec["group_size"] = 1, 8
        cfg = engine_config(spec)
        engine = Engine(tiny_model(0), cfg, mse_loss)
        try:
            history = engine.fit(worker_stream(0, 200))
        finally:
            engine.close()
        assert len(history) == args.steps == 10
        assert [h["samples"] for h in history] == [16] * 10  # B every step (world 1: it runs them all)
        sched = matched_schedule(1e-2, 10)
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
        ddp_sched, ddp_lrs = SharedLR(opt, sched), []
        for _ in range(10):
            ddp_lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            ddp_sched.step()
        assert [h["lr"] for h in history] == ddp_lrs, mode


# ------------------------------------------------------------------ the report
FINAL = {"torch-ddp": [2.30, 2.27, 2.24], "torch-ddp+powersgd4": [2.44, 2.45, 2.43],
         "zero1": [2.31, 2.28, 2.25], "acco": [2.32, 2.29, 2.26], "acco+loco4+int4params": [2.323, 2.2927, 2.2624]}
TIME = {"torch-ddp": 400.0, "torch-ddp+powersgd4": 90.0, "zero1": 420.0, "acco": 220.0,
        "acco+loco4+int4params": 160.0}
MB = {"torch-ddp": 8, "torch-ddp+powersgd4": 8, "zero1": 8, "acco": 4, "acco+loco4+int4params": 4}
WIRE = {"torch-ddp": 19.4e6, "torch-ddp+powersgd4": 1.3e6, "zero1": 19.4e6, "acco": 38.8e6,
        "acco+loco4+int4params": 5.1e6}


def matched_run(mode, lr, seed, final=None, t_end=None):
    """A made-up matched-batch run: 3072 samples at 16 per step, held-out loss falling
    linearly from final + 1 at 1536 samples to final at 3072 (its time at t_end)."""
    final = FINAL[mode][seed] if final is None else final
    t_end = (TIME[mode] * (1 + 0.05 * seed)) if t_end is None else t_end
    evals = [{"samples": 1536, "time_s": t_end / 2, "step": 96, "loss": final + 1.0},
             {"samples": 3072, "time_s": t_end, "step": 192, "loss": final}]
    return {"mode": mode, "lr": lr, "seed": seed, "steps": 192, "samples": 3072, "train_s": t_end,
            "startup_s": 1.0, "step_time_median_s": t_end / 192, "samples_per_s": 3072 / t_end,
            "protocol": "matched", "global_batch": 16, "micro_batch": MB[mode],
            "accumulation": 1 if mode.startswith("torch") else None,
            "global_micro_batches": None if mode.startswith("torch") else 16 // MB[mode],
            "samples_per_step_median": 16, "samples_per_step_mean": 16.0,
            "global_micro_batches_median": 16 // MB[mode] // (2 if mode.startswith("torch") else 1),
            "global_micro_batches_mean": 2.0, "min_micro_batches_median": 1, "comm_cpu_s_per_round": 0.1,
            "wire_bytes_per_step_engine": WIRE[mode], "wire_bytes_per_step_tx": WIRE[mode] * 1.04,
            "tx_over_engine_per_rank": [1.04, 1.05], "final_loss": final, "evals": evals,
            "compute_busy_per_rank": [0.8, 0.8], "phase_median_s": {}}


def matched_runs(args):
    runs = []
    for mode in args.modes:  # the sweep on seed 0: x0.5 worse, x2 worse, x1 best ...
        runs += [matched_run(mode, 5e-4, 0, final=FINAL[mode][0] + 0.1),
                 matched_run(mode, 2e-3, 0, final=FINAL[mode][0] + 0.05),
                 matched_run(mode, 1e-3, 0)]
    assert runs_for_seed(args, 1, runs) == [(1e-3, m) for m in args.modes]  # ... so seeds 1, 2 run at x1
    for seed in (1, 2):
        runs += [matched_run(mode, 1e-3, seed) for mode in args.modes]
    return runs


RATES = [{"tag": "s0", "micro_batch": 8, "samples_per_s": 25.0}, {"tag": "s0", "micro_batch": 4, "samples_per_s": 20.0}]


def test_the_matched_report_per_mode():
    args = parse_args(["--modes", ",".join(FINAL)])
    rows = {o["mode"]: o for o in aggregate(args, matched_runs(args), RATES)}
    ddp, acco4 = rows["torch-ddp"], rows["acco+loco4+int4params"]
    assert ddp["protocol"] == "matched" and ddp["reference"] == "torch-ddp" and ddp["global_batch"] == 16
    assert acco4["batch"] == "4 x 4/step (2 rounds)" and ddp["batch"] == "8 x acc 1"
    assert acco4["lr"] == 1e-3 and acco4["seeds"] == [0, 1, 2] and acco4["samples_per_step"] == 16
    # the target: DDP's final loss per seed; time to target: median and spread over the seeds
    assert ddp["loss_vs_ref_pct"] == 0.0 and ddp["time_to_target_s"] == pytest.approx(420.0)
    assert (ddp["time_to_target_min_s"], ddp["time_to_target_max_s"]) == pytest.approx((400.0, 440.0))
    # acco+loco4+int4params ends 1% above DDP on every seed: at 3072 samples it misses the target;
    # from (t/2, final + 1) to (t, final): it reaches DDP's final at t/2 + (1 - 0.01 final) / 1 x t/2
    pcts = [100 * (FINAL["acco+loco4+int4params"][s] / FINAL["torch-ddp"][s] - 1) for s in range(3)]
    assert acco4["loss_vs_ref_pct"] == pytest.approx(sorted(pcts)[1])
    assert acco4["loss_vs_ref_samples"] == 3072 and acco4["reached_target"] == "0/3"
    assert set(acco4["loss_vs_ref_pct_by_samples"]) == {"1536", "3072"}
    assert rows["acco"]["loss_vs_ref_pct"] == pytest.approx(100 * (2.29 / 2.27 - 1))
    # samples/s, bytes per step, and efficiencies at the mode's own micro-batch's compute pace
    assert acco4["samples_per_s"] == pytest.approx(3072 / 168.0) and acco4["wire_bytes_per_step_engine"] == 5.1e6
    assert acco4["compute_only_samples_per_s"] == 20.0 and ddp["compute_only_samples_per_s"] == 25.0
    assert acco4["throughput_efficiency"] == pytest.approx(3072 / 168.0 / 20.0)
    step = 168.0 / 192
    assert acco4["step_limit_s"] == pytest.approx(max(16 / 20.0, 5.1e6 / 12.5e6))
    assert acco4["overlap_efficiency"] == pytest.approx(0.8 / step)
    assert acco4["time_to_target_vs_ref"] is None and rows["acco"]["samples_per_s_vs_ref"] == pytest.approx(420 / 231)


def test_the_matched_table_and_verdict():
    args = parse_args(["--modes", ",".join(FINAL)])
    runs = matched_runs(args)
    runs = [r if r["mode"] != "acco+loco4+int4params" else
            {**r, **matched_run(r["mode"], r["lr"], r["seed"], final=r["final_loss"] - 0.05)} for r in runs]
    rows = aggregate(args, runs, RATES)
    by = {o["mode"]: o for o in rows}
    o = by["acco+loco4+int4params"]
    assert o["reached_target"] == "3/3" and o["loss_vs_ref_pct"] < 0
    # seed 0: linear from (80 s, 3.273) to (160 s, 2.273); DDP's final 2.30 is 0.973 of the way
    assert o["time_to_target_per_seed"][0] == pytest.approx(80 + 80 * 0.973)
    text = report_text(rows)
    assert "| mode | lr | batch | samples/step |" in text and "vs DDP @ equal samples" in text
    assert "| acco+loco4+int4params | 0.001 | 4 x 4/step (2 rounds) | 16 | 3072 |" in text
    assert "| torch-ddp | 0.001 | 8 x acc 1 | 16 | 3072 |" in text and "+0.0%" in text
    lines = verdict(rows)
    assert "held-out loss -1.2% vs torch-ddp at 3072 samples" in lines
    # PowerSGD's final (2.44, 2.45, 2.43) at 0.833, 0.793, 0.782 of the second half: 147, 151, 157 s;
    # PowerSGD itself at its end, 90, 94.5, 99 s
    assert "reaches torch-ddp+powersgd4's final loss at 151 s (3/3 seeds), torch-ddp+powersgd4 at 94 s" in lines
    assert "time to target 0.39x best torch-ddp (torch-ddp)" in lines  # 165.7 s / 420 s
    assert "zero1 +0.4%, acco +0.9%" in lines and "acco - zero1: the one-step delay" in lines


def report_text(rows):
    from benchmarks.report import table

    return table(rows)


def test_the_json_renders_again_and_plots(tmp_path, capsys):
    args = parse_args(["--modes", ",".join(FINAL), "--json", str(tmp_path / "b.json")])
    write_outputs(args, matched_runs(args), RATES, final=True)
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["config"]["batch_plans"]["acco"]["micro_batch"] == 4 and doc["config"]["protocol"] == "matched"
    assert doc["compute_only"] == RATES and doc["compute_only_samples_per_s"] == [25.0]
    plot = tmp_path / "loss.png"
    assert main(["--render", str(tmp_path / "b.json"), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "| acco+loco4+int4params | 0.001 | 4 x 4/step (2 rounds) |" in out and "micro-batch 4: 20.00" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loss_at_samples_interpolates():
    evals = [{"samples": 100, "loss": 3.0}, {"samples": 200, "loss": 2.0}, {"samples": 300, "loss": None}]
    assert loss_at_samples(evals, 150) == pytest.approx(2.5)
    assert loss_at_samples(evals, 200) == 2.0
    assert loss_at_samples(evals, 250) is None and loss_at_samples(evals, 50) is None
    assert math.isclose(loss_at_samples(evals, 100), 3.0)


def test_equal_shares_zero1_keeps_equal_shares_under_speed_balance():
    # --hetero --balance speed: zero1 takes speed shares, zero1+equal-shares the status quo
    args = parse_args(["--hetero", "--global-batch", "48", "--balance", "speed",
                       "--modes", "zero1,zero1+equal-shares,acco"])
    balance = {m: engine_config(train_spec(args, m, 1e-3, 0)).balance for m in args.modes}
    assert balance == {"zero1": "speed", "zero1+equal-shares": "equal", "acco": "speed"}


# ------------------------------------------------------------------ one global order of the data
def test_matched_modes_read_step_t_from_the_same_windows_whatever_the_micro_batch_or_shares():
    """Dealt data: DDP (micro-batch 8, accumulation 2 on 2 ranks) and ACCO (micro-batch 4, 4 +
    4 micro-batches per step in 2 rounds, uneven speed shares) read the same windows per step."""
    from benchmarks.worker import ddp_stream
    from engine.batch.dealing import dealt_index
    from lm.data import TokenBatches

    tokens = torch.arange(20_000) % 251
    big, small = (TokenBatches(tokens, 32, mb, rank=0, world_size=1, seed=3) for mb in (8, 4))
    world, acc, steps = 2, 2, 5
    ddp = [ddp_stream(big, {"data": "dealt"}, r, world, acc) for r in range(world)]
    shares = [[3, 1], [1, 3]]  # per round of a step: ranks 0 and 1
    for t in range(steps):
        ddp_windows = {int(s) for r in range(world) for _ in range(acc)
                       for s in big.window_starts(_index_of(big, next(ddp[r])))}
        acco_windows = {int(s) for k in range(2) for r in range(world) for p in range(shares[k][r])
                        for s in small.window_starts(dealt_index(2 * t + k, p, r, shares[k], 8, 2))}
        assert len(ddp_windows) == 32 and ddp_windows == acco_windows


def _index_of(stream, batch) -> int:
    """Which micro-batch of ``stream`` ``batch`` is (the first 64 are enough here)."""
    for i in range(64):
        if torch.equal(stream.batch(i)["input_ids"], batch["input_ids"]):
            return i
    raise AssertionError("not a micro-batch of this stream")


def test_each_mode_reads_the_data_in_the_order_its_protocol_deals(tmp_path, capsys):
    from benchmarks.runner import data_order

    matched = parse_args(["--modes", "torch-ddp,acco+loco4+int4params,sparseloco-h15"])
    assert [data_order(matched, m) for m in ("torch-ddp", "acco+loco4+int4params", "sparseloco-h15")] == \
        ["dealt", "dealt", "per-rank"]
    assert train_spec(matched, "acco+loco4+int4params", 1e-3, 0)["data"] == "dealt"
    assert train_spec(matched, "sparseloco-h15", 1e-3, 0)["data"] == "per-rank"
    free = parse_args(["--protocol", "free", "--modes", "torch-ddp-acc1,acco+loco4"])
    assert data_order(free, "acco+loco4") == "per-rank"
    # under speed shares, a table measured before the dealt order (its runs carry no "data") is
    # not merged into a new one: a fast worker read further into its own stream
    before = Path(__file__).resolve().parents[2] / "docs" / "results" / "bench_hetero_b48_s0.json"
    assert main(["--hetero", "--balance", "speed", "--global-batch", "48", "--modes", "torch-ddp,zero1",
                 "--merge", str(before), "--json", str(tmp_path / "new.json")]) == 2
    err = capsys.readouterr().err
    assert "acco, acco+loco4+int4params, zero1 read each worker's own stream" in err  # not DDP, not equal shares
