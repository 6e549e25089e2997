"""The benchmark's bookkeeping, on made-up runs (no testbed, no root): which lr each seed runs
after a sweep, which lr a mode keeps, time to target, and the verdict lines (the free-batch
protocol's; the matched-batch protocol's are in test_benchmark_matched.py)."""

from __future__ import annotations

import json

import pytest

from benchmarks.report import aggregate, time_to_target, time_to_target_fields, verdict
from benchmarks.runner import runs_for_seed
from recipes.benchmark import parse_args


def fake_run(mode, lr, seed, final, t_end=100.0, sps=10.0, wire=1e6):
    evals = [{"samples": 100, "time_s": t_end / 2, "step": 5, "loss": final + 1.0},
             {"samples": 200, "time_s": t_end, "step": 10, "loss": final}]
    return {"mode": mode, "lr": lr, "seed": seed, "steps": 10, "samples": 200, "train_s": t_end,
            "startup_s": 1.0, "step_time_median_s": 1.0, "samples_per_s": sps,
            "global_micro_batches_median": 2, "global_micro_batches_mean": 2.0,
            "min_micro_batches_median": 1, "comm_cpu_s_per_round": 0.1,
            "wire_bytes_per_step_engine": wire, "wire_bytes_per_step_tx": wire * 1.04,
            "tx_over_engine_per_rank": [1.04, 1.05], "final_loss": final, "evals": evals,
            "compute_busy_per_rank": [0.8, 0.8], "phase_median_s": {}}


def test_time_to_target_interpolates_between_eval_points():
    evals = [{"time_s": 10.0, "loss": 3.0}, {"time_s": 20.0, "loss": 2.0}, {"time_s": 30.0, "loss": 1.5}]
    assert time_to_target(evals, 2.5) == pytest.approx(15.0)
    assert time_to_target(evals, 3.5) == pytest.approx(10.0)
    assert time_to_target(evals, 1.0) is None


def test_time_to_target_median_counts_a_missed_seed_as_never():
    def run(seed, losses):
        return {"seed": seed, "evals": [{"time_s": 10.0 * (i + 1), "loss": x} for i, x in enumerate(losses)]}
    targets = {0: 2.0, 1: 2.0, 2: 2.0}
    reached_at_10, reached_at_30, missed = run(0, [1.9, 1.8, 1.7]), run(1, [2.5, 2.2, 2.0]), run(2, [2.5, 2.4, 2.3])
    two_of_three = time_to_target_fields([reached_at_10, reached_at_30, missed], targets)
    assert two_of_three["time_to_target_s"] == pytest.approx(30.0)  # the slower reached seed, not their median 20
    assert two_of_three["time_to_target_reached_median_s"] == pytest.approx(20.0)
    assert two_of_three["reached_target"] == "2/3" and two_of_three["time_to_target_per_seed"][2] is None
    one_of_three = time_to_target_fields([reached_at_10, missed, run(2, [2.5, 2.5, 2.5])], targets)
    assert one_of_three["time_to_target_s"] is None and one_of_three["time_to_target_min_s"] == pytest.approx(10.0)


def test_sweep_seeds_then_each_modes_best_lr():
    args = parse_args(["--modes", "zero1,acco", "--seeds", "3", "--lr-sweep", "--sweep-seeds", "1", "--lr", "1e-3"])
    assert runs_for_seed(args, 0, []) == [(lr, m) for lr in (5e-4, 1e-3, 2e-3) for m in ("zero1", "acco")]
    done = [fake_run("zero1", 5e-4, 0, 2.6), fake_run("zero1", 1e-3, 0, 2.5), fake_run("zero1", 2e-3, 0, 2.7),
            fake_run("acco", 5e-4, 0, 2.9), fake_run("acco", 1e-3, 0, 2.8), fake_run("acco", 2e-3, 0, 2.7)]
    assert runs_for_seed(args, 1, done) == [(1e-3, "zero1"), (2e-3, "acco")]
    # later seeds do worse at the best lr: the choice still rests on the swept seed only
    done += [fake_run("acco", 2e-3, s, 3.5) for s in (1, 2)]
    rows = {o["mode"]: o for o in aggregate(args, done, [20.0])}
    assert rows["acco"]["lr"] == 2e-3 and rows["acco"]["seeds"] == [0, 1, 2]
    assert rows["zero1"]["lr"] == 1e-3


def test_lr_from_reads_an_earlier_result(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"modes": [{"mode": "acco", "lr": 2e-3}]}))
    args = parse_args(["--modes", "zero1,acco", "--lr-from", str(path), "--lr", "1e-3"])
    assert runs_for_seed(args, 0, []) == [(1e-3, "zero1"), (2e-3, "acco")]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        parse_args(["--lr-from", str(bad)])
    with pytest.raises(SystemExit):
        parse_args(["--lr-from", str(path), "--lr-sweep"])


def test_verdict_compares_against_the_best_ddp_and_powersgd():
    args = parse_args(["--protocol", "free", "--seeds", "1",
                       "--modes", "torch-ddp-acc1,torch-ddp-acc4,torch-ddp+powersgd4,zero1,acco,acco+loco4"])
    runs = [fake_run("torch-ddp-acc1", 1e-3, 0, 2.5, t_end=200, wire=19e6),
            fake_run("torch-ddp-acc4", 1e-3, 0, 2.4, t_end=100, wire=19e6),
            fake_run("torch-ddp+powersgd4", 1e-3, 0, 2.45, t_end=80),
            fake_run("zero1", 1e-3, 0, 2.5, sps=6.0),
            fake_run("acco", 1e-3, 0, 2.55, sps=9.0),
            fake_run("acco+loco4", 1e-3, 0, 2.3, t_end=60, wire=7.6e6)]
    rows = aggregate(args, runs, [20.0])
    text = verdict(rows)
    # target 2.5 (acc1's final loss), linear between (t/2, final + 1) and (t, final):
    # acc4 at 50 + 0.9 * 50 = 95 s, PowerSGD at 40 + 0.95 * 40 = 78 s, acco+loco4 at 30 + 0.8 * 30 = 54 s
    assert "time to target 0.57x best torch-ddp (torch-ddp-acc4)" in text
    assert "0.69x best PowerSGD (torch-ddp+powersgd4)" in text
    assert "wire bytes/step 0.400x torch-ddp" in text
    assert "acco vs zero1: samples/s 1.50x" in text


def test_verdict_compares_acco_with_zero1_with_and_without_speed_shares():
    args = parse_args(["--hetero", "--global-batch", "48", "--balance", "speed", "--seeds", "1", "--no-lr-sweep",
                       "--modes", "torch-ddp,zero1,zero1+equal-shares,acco,acco+loco4+int4params"])
    runs = [fake_run("torch-ddp", 1e-3, 0, 2.5), fake_run("zero1", 1e-3, 0, 2.5, sps=12.0),
            fake_run("zero1+equal-shares", 1e-3, 0, 2.5, sps=8.0), fake_run("acco", 1e-3, 0, 2.525, sps=16.0),
            fake_run("acco+loco4+int4params", 1e-3, 0, 2.45, sps=20.0)]
    text = verdict(aggregate(args, runs, [20.0]))
    assert "acco vs zero1: samples/s 1.33x, final held-out loss 1.010x" in text
    assert "acco vs zero1+equal-shares: samples/s 2.00x" in text
    assert "acco+loco4+int4params vs zero1+equal-shares: samples/s 2.50x, final held-out loss 0.980x" in text


def test_overlap_efficiency_is_the_physical_limit_over_the_step_time():
    from benchmarks.report import add_derived
    from benchmarks.testbed import parse_rate

    assert parse_rate("100mbit") == 1e8 and parse_rate("1gbit") == 1e9 and parse_rate("20mbit") == 2e7
    # 2 micro-batches of 8 at 16 samples/s compute-only: 1 s; 12.5 MB at 100 Mbit/s: 1 s -> limit 1 s
    rows = [{"mode": "x", "compute_only_samples_per_s": 16.0, "global_micro_batches_per_step": 2,
             "wire_bytes_per_step_engine": 12.5e6, "step_time_median_s": 2.0, "samples_per_s": 8.0,
             "time_to_target_s": None}]
    add_derived(rows, 2, "100mbit", 8)
    assert rows[0]["step_limit_s"] == pytest.approx(1.0) and rows[0]["overlap_efficiency"] == pytest.approx(0.5)


def test_later_seeds_use_the_lr_the_sweep_seeds_chose():
    # seed 1 ran at the swept best and did worse: seed 2 must still run there
    args = parse_args(["--modes", "zero1", "--seeds", "3", "--lr-sweep", "--sweep-seeds", "1", "--lr", "1e-3"])
    done = [fake_run("zero1", 5e-4, 0, 2.60), fake_run("zero1", 1e-3, 0, 2.59), fake_run("zero1", 2e-3, 0, 3.3),
            fake_run("zero1", 1e-3, 1, 2.70)]
    assert runs_for_seed(args, 2, done) == [(1e-3, "zero1")]


def test_a_sweep_that_would_sweep_nothing_is_refused(capsys):
    # later seeds take the sweep seeds' best lr: with no earlier runs there is nothing to take it from
    with pytest.raises(SystemExit):
        parse_args(["--modes", "zero1", "--first-seed", "1", "--seeds", "2"])
    assert "nothing would be swept" in capsys.readouterr().err
    assert parse_args(["--modes", "zero1", "--first-seed", "1", "--seeds", "2", "--no-lr-sweep"]).lrs == [1e-3]
    assert parse_args(["--modes", "zero1", "--first-seed", "1", "--merge", "a.json"]).lr_sweep


def test_merge_adds_seeds_to_an_earlier_table(tmp_path):
    from benchmarks.runner import load_runs

    args = parse_args(["--protocol", "free", "--modes", "torch-ddp-acc1,zero1", "--seeds", "1"])
    first = aggregate(args, [fake_run("torch-ddp-acc1", 1e-3, 0, 2.5), fake_run("zero1", 1e-3, 0, 2.6)], [20.0])
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"modes": first, "compute_only_samples_per_s": [20.0]}))
    runs, rates = load_runs(str(path))
    more = parse_args(["--protocol", "free", "--modes", "zero1", "--seeds", "1", "--first-seed", "1",
                       "--lr-from", str(path)])
    rows = {o["mode"]: o for o in aggregate(more, runs + [fake_run("zero1", 1e-3, 1, 2.4)], rates)}
    assert set(rows) == {"torch-ddp-acc1", "zero1"} and rows["zero1"]["seeds"] == [0, 1]
    assert rows["zero1"]["final_heldout_loss"] == pytest.approx(2.5)  # median of 2.6 and 2.4


def test_onebit_and_local_verdicts_compare_like_for_like():
    from benchmarks.report import tables
    from benchmarks.runner import after_freeze_bytes

    hist = [{"step": s, "wire_bytes": b} for s, b in ((1, 19e6), (2, 19e6), (3, 40e6), (4, 0.75e6), (5, 0.75e6))]
    assert after_freeze_bytes(hist, 3) == 0.75e6 and after_freeze_bytes(hist, None) is None
    args = parse_args(["--seeds", "1", "--no-lr-sweep", "--samples", "160",
                       "--modes", "torch-ddp,zero1,onebit-adam,diloco-h15,sparseloco-h15,sparseloco-h15+overlap"])
    onebit = {**fake_run("onebit-adam", 1e-3, 0, 2.525), "wire_bytes_per_step_after_freeze": 0.76e6,
              "strategy_facts": {"frozen_step": 20}}
    runs = [fake_run("torch-ddp", 1e-3, 0, 2.5, wire=19e6), fake_run("zero1", 1e-3, 0, 2.5, wire=19e6), onebit,
            {**fake_run("diloco-h15", 1e-3, 0, 2.4, t_end=50, wire=1.3e6), "step_time_mean_s": 0.5},
            {**fake_run("sparseloco-h15", 1e-3, 0, 2.45, t_end=40, wire=0.012e6), "step_time_mean_s": 0.4},
            {**fake_run("sparseloco-h15+overlap", 1e-3, 0, 2.5, t_end=30, wire=0.012e6), "step_time_mean_s": 0.3}]
    text = tables(aggregate(args, runs, [20.0]))
    # 1-bit Adam: 19e6 / 0.76e6 = 25.0; (2.525 / 2.5 - 1) = +1.0% at 200 samples
    assert "onebit-adam (freeze after 20 steps): bytes per step after the freeze 0.760 MB, 1/25.0 of zero1;" in text
    assert "held-out loss +1.0% vs zero1 at 200 samples" in text and "time to target not reached vs torch-ddp 100 s" in text
    # the local modes: bytes per sample against DDP's (the same samples per step here), the loss
    # against diloco at the same H and against the same mode without overlap, seed against seed
    # the target 2.5 is reached at 20 + 0.95 x 20 = 39 s, DDP's at 100 s
    assert "sparseloco-h15 (200 samples): time to target 0.39x torch-ddp;" in text
    assert "bytes per sample 1/1583 of torch-ddp" in text
    assert "vs diloco-h15 +2.1% at 200 samples" in text
    assert "sparseloco-h15+overlap (200 samples):" in text and "vs without overlap +2.0% at 200 samples" in text


def test_snapshots_of_a_partly_frozen_model_hold_only_what_trains(monkeypatch):
    """The real-model mode trains the top blocks only: a snapshot copies those (135M fp32 copies per
    eval point would not fit), and evaluating a snapshot puts them back, the frozen ones untouched."""
    import torch

    from benchmarks.worker import Snapshots

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    snaps = Snapshots([10], t0=0.0)
    snaps.maybe(model, samples=10, step=1)
    assert [p.shape for p in snaps.taken[0]["params"]] == [model[1].weight.shape, model[1].bias.shape]
    kept = model[1].weight.detach().clone()
    with torch.no_grad():
        model[1].weight.add_(1.0)
    held = [{"input_ids": torch.zeros(1, 2, dtype=torch.long)}]
    seen = []
    monkeypatch.setattr("lm.data.eval_loss", lambda m, h: (seen.append(m[1].weight.detach().clone()),
                                                           type("R", (), {"loss": 1.0})())[1])
    rows = snaps.evaluate(model, held, rank=0, world=1)
    assert rows[0]["loss"] == 1.0 and torch.equal(seen[0], kept)
    assert torch.equal(model[0].weight, frozen)


def test_every_mode_is_evaluated_on_the_same_held_out_sequences():
    """A mode's micro-batch (acco's half of DDP's at a matched batch) must not change the held-out
    set: the eval batches are the command's --micro-batch for every mode."""
    import torch

    from benchmarks.runner import train_spec
    from benchmarks.worker import build_data

    args = parse_args(["--modes", "torch-ddp,acco", "--seeds", "1", "--no-lr-sweep", "--global-batch", "16",
                       "--micro-batch", "8", "--eval-batches", "2", "--seq-len", "32"])
    specs = {m: train_spec(args, m, 1e-3, 0) for m in ("torch-ddp", "acco")}
    assert specs["torch-ddp"]["micro_batch"] != specs["acco"]["micro_batch"]  # the premise
    held = {m: build_data(s, 0, 2)[2] for m, s in specs.items()}
    a, b = held["torch-ddp"], held["acco"]
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"])


def test_merge_refuses_runs_scored_on_another_heldout_set(tmp_path, capsys):
    """A run at --micro-batch 4 and the default --eval-batches 8 scores 32 held-out sequences, half
    of the 64 the default command scores: merging it into a table would compare two sets (zero1
    at micro-batch 4 read 2.245 on the half against DDP's 2.280 on the whole, the same model to
    0.02% on the same set)."""
    from recipes.benchmark import merged_runs

    args = parse_args(["--modes", "zero1", "--seeds", "1", "--no-lr-sweep"])
    rows = aggregate(args, [{**fake_run("zero1", 1e-3, 0, 2.5), "protocol": "matched", "global_batch": 16}], [20.0])

    def write(name: str, **cfg) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"modes": rows, "compute_only_samples_per_s": [20.0],
                                    "config": {"heldout": args.heldout, "seq_len": args.seq_len, **cfg}}))
        return str(path)

    half = write("half.json", micro_batch=4, eval_micro_batch=4, eval_batches=8)
    same = write("same.json", micro_batch=4, eval_micro_batch=4, eval_batches=16)
    old = write("old.json", micro_batch=8, eval_batches=8)  # before eval_micro_batch: the command's micro-batch
    assert merged_runs(parse_args(["--modes", "zero1", "--merge", half])) is None
    assert "another held-out set" in capsys.readouterr().err
    for path in (same, old):
        merged = merged_runs(parse_args(["--modes", "zero1", "--merge", path]))
        assert merged is not None and len(merged[0]) == 1


def test_merge_only_writes_runs_from_two_files_as_one_table_against_the_reference(tmp_path, capsys):
    """Seeds or modes that ran into a file of their own join the table that holds the reference,
    with nothing run: each mode scored against torch DDP seed by seed."""
    from recipes.benchmark import main

    args = parse_args(["--modes", "zero1", "--seeds", "1", "--no-lr-sweep"])

    def write(name: str, runs: list[dict]) -> str:
        rows = aggregate(args, [{**r, "protocol": "matched", "global_batch": 16} for r in runs], [20.0])
        path = tmp_path / name
        path.write_text(json.dumps({"modes": rows, "compute_only_samples_per_s": [20.0],
                                    "config": {"heldout": args.heldout, "seq_len": args.seq_len,
                                               "micro_batch": args.micro_batch, "eval_batches": args.eval_batches}}))
        return str(path)

    ref = write("ddp.json", [fake_run("torch-ddp", 1e-3, s, 2.5) for s in (0, 1)])
    new = write("zero1.json", [fake_run("zero1", 1e-3, 0, 2.55), fake_run("zero1", 1e-3, 1, 2.5)])
    out = tmp_path / "both.json"
    assert main(["--modes", "zero1", "--no-lr-sweep", "--merge-only", "--merge", ref, "--merge", new,
                 "--json", str(out)]) == 0
    rows = {o["mode"]: o for o in json.loads(out.read_text())["modes"]}
    assert set(rows) == {"torch-ddp", "zero1"} and rows["zero1"]["seeds"] == [0, 1]
    assert rows["zero1"]["loss_vs_ref_pct_per_seed"] == {"0": pytest.approx(2.0), "1": pytest.approx(0.0)}
    # a run in two files counts once; the same run with another result is refused
    assert main(["--modes", "zero1", "--no-lr-sweep", "--merge-only", "--merge", ref, "--merge", new, "--merge",
                 str(out), "--json", str(tmp_path / "again.json")]) == 0
    again = {o["mode"]: o for o in json.loads((tmp_path / "again.json").read_text())["modes"]}
    assert [len(again[m]["runs"]) for m in ("torch-ddp", "zero1")] == [2, 2]
    assert len(json.loads((tmp_path / "again.json").read_text())["compute_only"]) == 1  # one measurement, once
    other = write("other.json", [fake_run("zero1", 1e-3, 0, 2.6)])
    assert main(["--modes", "zero1", "--no-lr-sweep", "--merge-only", "--merge", new, "--merge", other,
                 "--json", str(tmp_path / "no.json")]) == 2
    assert "ran before in another --merge file" in capsys.readouterr().err
    # runs at another clipping do not join the table
    assert main(["--modes", "zero1", "--no-lr-sweep", "--merge-only", "--merge", ref, "--merge", new,
                 "--max-grad-norm", "0", "--json", str(tmp_path / "no.json")]) == 2
    assert "clipped the gradient norm at 1.0" in capsys.readouterr().err and not (tmp_path / "no.json").exists()
    with pytest.raises(SystemExit):  # nothing to write, or nowhere to write it
        parse_args(["--modes", "zero1", "--merge-only", "--merge", ref])
    assert "--merge-only writes" in capsys.readouterr().err
