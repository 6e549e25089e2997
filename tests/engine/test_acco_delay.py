"""ACCO's delay corrections (acco_loco/delay.py, the ``acco`` section) and its synchronous first
steps (``sync_steps``) against a float64 sequential computation of the same schedule, at world
size 1 and 2 (chunked collectives)."""

from __future__ import annotations

import pytest
import torch

from acco_loco import delay
from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import Reference, flat_params, mse_loss, rel_err, tiny_model, worker_stream

STEPS, K = 20, 2
LAMBDA, S = 20.0, 1.0  # big enough on the tiny model to move the trajectory well past float error
CORRECTIONS = {"dc": {"delay_compensation": LAMBDA}, "wp": {"weight_prediction": S},
               "both": {"delay_compensation": LAMBDA, "weight_prediction": S}}
SYNC = 5  # synchronous first steps, then ACCO


def run_engine(rank: int, world: int, settings: dict, chunks: int = 1, opt: str = "adamw", step_copy: str = "auto"):
    model = tiny_model(seed=0)
    cfg = EngineConfig(strategy="acco", optimizer=opt, lr=1e-2, micro_batches=K, accumulation="fixed",
                       max_steps=STEPS, align=8, weight_decay=0.1 if opt == "adamw" else 0.0, momentum=0.9,
                       comm_chunks=chunks, step_copy=step_copy, **settings)
    engine = Engine(model, cfg, mse_loss)
    it = iter(worker_stream(rank, 3 * K * (STEPS + 1)))
    out = []
    for _ in range(STEPS):
        engine.fit(it, steps=1)
        out.append(flat_params(model))
    engine.close()
    return out


def reference(world: int, dc: float = 0.0, wp: float = 0.0, opt: str = "adamw", sync: int = 0) -> list[torch.Tensor]:
    """ACCO's schedule (tests/tiny.py Reference.run("acco")) with the corrections written out in
    float64: the stale half gtilde_t, computed on the estimate thetatilde_t and applied at theta_t,
    gets + dc * g*g * (theta_t - thetatilde_t) on its mean (Zheng et al. 2017); with wp > 0 the
    estimate is theta_t + wp * (theta_t - theta_{t-1}) instead of the half-batch step. The first
    ``sync`` steps compute both halves at theta_t (the data in the same order)."""
    streams = [worker_stream(r, 3 * K * (STEPS + 1)) for r in range(world)]
    kwargs = {"weight_decay": 0.1} if opt == "adamw" else {"momentum": 0.9}
    ref = Reference(tiny_model(seed=0), streams, K, opt=opt, lr=1e-2, **kwargs)
    point = ref.theta.detach().clone()  # thetatilde_0 = theta_0
    last_update = torch.zeros_like(point)
    gt, ct = ref.grads(point)
    out = []
    for t in range(STEPS):
        theta = ref.theta.detach().clone()
        if t < sync:  # the stale half was computed here too: nothing to compensate
            g, c = ref.grads(theta)
            ref.apply(gt + g, ct + c)
            last_update = ref.theta.detach() - theta
            point = ref.theta.detach().clone()
            gt, ct = ref.grads(point)
            out.append(ref.theta.detach().clone())
            continue
        mean = gt / ct
        gt = (mean + dc * mean * mean * (theta - point)) * ct
        estimate = theta + wp * last_update if wp else ref.estimate(gt, ct)
        g, c = ref.grads(theta)  # the fresh half, beside the estimate round
        gt_next, ct_next = ref.grads(estimate)  # the next stale half, beside the commit round
        ref.apply(gt + g, ct + c)
        last_update = ref.theta.detach() - theta
        point, gt, ct = estimate, gt_next, ct_next
        out.append(ref.theta.detach().clone())
    return out


CLIP = 0.3  # below the tiny model's gradient norms (0.3-1.1 over the run): every round is clipped


def reference_clipped(world: int, estimate_clip: str) -> list[torch.Tensor]:
    """ACCO's schedule with clipping at CLIP, in float64: the commit clipped by its whole step's
    norm (torch's rule, acco_loco/optim.py clip_coefficient), the estimate by its own half's
    ('half') or by the last commit's norm ('step'; the first step's by its own)."""
    streams = [worker_stream(r, 3 * K * (STEPS + 1)) for r in range(world)]
    ref = Reference(tiny_model(seed=0), streams, K, lr=1e-2, weight_decay=0.1)

    def coef(norm):
        return min(1.0, CLIP / (norm + 1e-6))

    gt, ct = ref.grads(ref.theta)
    last, out = None, []
    for _ in range(STEPS):
        norm = (gt / ct).norm().item()
        used = norm if estimate_clip == "half" or last is None else last
        estimate = ref.estimate(gt * coef(used), ct)
        g, c = ref.grads(ref.theta)
        gt_next, ct_next = ref.grads(estimate)
        last = ((gt + g) / (ct + c)).norm().item()
        ref.apply((gt + g) * coef(last), ct + c)
        gt, ct = gt_next, ct_next
        out.append(ref.theta.detach().clone())
    return out


@pytest.mark.parametrize("estimate_clip", ["half", "step"])
def test_estimate_clip_matches_reference(estimate_clip):
    got = run_engine(0, 1, {"max_grad_norm": CLIP, "estimate_clip": estimate_clip}, chunks=3)
    want = reference_clipped(1, estimate_clip)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) < 1e-6, errs
    other = reference_clipped(1, "half" if estimate_clip == "step" else "step")
    assert rel_err(want[-1], other[-1]) > 1e-4  # the two clips give two trajectories


def test_compensate_and_predict_math():
    s = torch.tensor([2.0, -4.0, 0.0], dtype=torch.float64)
    drift = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    # mean g = s / 2 = [1, -2, 0]; g + 0.1 g^2 drift = [1.05, -1.6, 0]; times the count 2
    got = delay.compensate_(s.clone(), 2, drift, 0.1)
    assert torch.allclose(got, torch.tensor([2.1, -3.2, 0.0], dtype=torch.float64))
    assert torch.equal(delay.compensate_(s.clone(), 2, drift, 0.0), s)
    out = torch.empty(3, dtype=torch.float64)
    delay.predict_(out, s, drift, 2.0)
    assert torch.equal(out, s + 2.0 * drift)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
@pytest.mark.parametrize("step_copy", ["whole", "piece"])  # the corrections read the spare, or a piece's scratch
def test_world1_matches_reference(name, step_copy):
    settings = CORRECTIONS[name]
    got = run_engine(0, 1, settings, chunks=3, step_copy=step_copy)
    want = reference(1, settings.get("delay_compensation", 0.0), settings.get("weight_prediction", 0.0))
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) < 1e-6, errs
    plain = Reference(tiny_model(seed=0), [worker_stream(0, 3 * K * (STEPS + 1))], K, lr=1e-2,
                      weight_decay=0.1).run("acco", STEPS)
    # the correction changed the trajectory (so the comparison above is not ACCO's own)
    assert rel_err(want[-1], plain[-1]) > 1e-4


def test_sgd_weight_prediction_matches_reference():
    got = run_engine(0, 1, {"weight_prediction": 2.0}, opt="sgd")
    want = reference(1, wp=2.0, opt="sgd")
    assert max(rel_err(g, w) for g, w in zip(got, want)) < 1e-6


@pytest.mark.parametrize("name", ["none", "both"])
def test_sync_steps_match_reference(name):
    settings = CORRECTIONS.get(name, {})
    got = run_engine(0, 1, {**settings, "sync_steps": SYNC}, chunks=3)
    dc, wp = settings.get("delay_compensation", 0.0), settings.get("weight_prediction", 0.0)
    want = reference(1, dc, wp, sync=SYNC)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) < 1e-6, errs
    # not ACCO's trajectory, nor a fully synchronous one: the switch happened at step SYNC
    assert rel_err(want[-1], reference(1, dc, wp)[-1]) > 1e-4
    assert rel_err(want[-1], reference(1, dc, wp, sync=STEPS)[-1]) > 1e-4
    assert rel_err(want[SYNC - 1], reference(1, dc, wp, sync=STEPS)[SYNC - 1]) < 1e-12


def test_sync_steps_throughout_are_zero1s_update():
    got = run_engine(0, 1, {"sync_steps": STEPS}, chunks=3)
    model = tiny_model(seed=0)
    cfg = EngineConfig(strategy="zero1", lr=1e-2, micro_batches=2 * K, accumulation="fixed", max_steps=STEPS,
                       align=8, weight_decay=0.1, comm_chunks=3)
    engine = Engine(model, cfg, mse_loss)
    engine.fit(iter(worker_stream(0, 3 * K * (STEPS + 1))))
    engine.close()
    assert rel_err(got[-1], flat_params(model)) < 1e-6


def _both_worlds(rank: int, world: int):
    out = {name: run_engine(rank, world, CORRECTIONS[name], chunks=3) for name in ("dc", "wp")}
    out["sync"] = run_engine(rank, world, {**CORRECTIONS["dc"], "sync_steps": SYNC}, chunks=3)
    out["clip"] = run_engine(rank, world, {"max_grad_norm": CLIP, "estimate_clip": "step"}, chunks=3)
    return out


def test_two_process_groups_match_reference_and_stay_identical():
    results = spawn(_both_worlds, 2)
    wants = {"dc": reference(2, dc=LAMBDA), "wp": reference(2, wp=S), "sync": reference(2, dc=LAMBDA, sync=SYNC),
             "clip": reference_clipped(2, "step")}
    for name, want in wants.items():
        for step in range(STEPS):
            assert torch.equal(results[1][name][step], results[0][name][step]), (name, step)
            assert rel_err(results[0][name][step], want[step]) < 1e-6, (name, step)


def test_defaults_are_acco_as_published():
    cfg = EngineConfig(strategy="acco")
    assert (cfg.delay_compensation, cfg.weight_prediction) == (0.0, 0.0)
    with pytest.raises(ValueError, match="strategy 'zero1' does not read the 'acco' section"):
        EngineConfig(strategy="zero1", delay_compensation=1.0)
    with pytest.raises(ValueError, match="weight_prediction must be a finite number >= 0"):
        EngineConfig(strategy="acco", weight_prediction=-1.0)
    assert EngineConfig(strategy="acco").sync_steps == 0
    assert EngineConfig(strategy="acco").estimate_clip == "half"


# 8: saved in the synchronous steps, resumed across the switch; "dc": the estimate is the clipped
# half-batch step (weight prediction would replace it), so the last commit's norm is read on resume
@pytest.mark.parametrize("sync,corrections", [(0, "both"), (8, "both"), (0, "dc")])
def test_resumed_run_with_the_corrections_is_bit_identical(tmp_path, sync, corrections):
    from engine import GlobalBatches

    stream = worker_stream(0, 64)
    # estimate_clip='step' with every round clipped: the last commit's norm must come back too
    cfg = EngineConfig(strategy="acco", lr=1e-2, global_micro_batches=4, max_steps=12, align=8,
                       sync_steps=sync, max_grad_norm=CLIP, estimate_clip="step", **CORRECTIONS[corrections])
    straight = Engine(tiny_model(0), cfg, mse_loss)
    straight.fit(GlobalBatches(stream.__getitem__))
    straight.close()
    first = Engine(tiny_model(0), cfg, mse_loss)
    first.fit(GlobalBatches(stream.__getitem__), steps=6)
    first.save(str(tmp_path / "ckpt"))
    first.close()
    model = tiny_model(5)
    resumed = Engine.load(str(tmp_path / "ckpt"), model, cfg, mse_loss)
    resumed.fit(GlobalBatches(stream.__getitem__))
    resumed.close()
    assert torch.equal(flat_params(straight.model), flat_params(model))
    assert len(resumed.history) and resumed.history[-1]["step"] == 12


def test_benchmark_modes_set_the_corrections():
    from benchmarks.modes import BENCHMARK_MODES, DC_LAMBDA, MODES, SYNC_STEPS, matched_batch

    for name, field, value in (("acco+dc", "delay_compensation", DC_LAMBDA), ("acco+wp", "weight_prediction", 1.0),
                               ("acco+sync", "sync_steps", SYNC_STEPS), ("acco+stepclip", "estimate_clip", "step")):
        assert name in BENCHMARK_MODES
        cfg = EngineConfig(**MODES[name].engine_kwargs())
        assert getattr(cfg, field) == value and cfg.strategy == "acco"
        # matched like acco: 4 x 4 per step in 2 rounds at B = 16 on 2 workers
        assert matched_batch(name, 16, 2, 8) == matched_batch("acco", 16, 2, 8)


def test_the_probe_runs_and_its_least_squares_fit_never_adds_error(capsys):
    import re

    from benchmarks.acco_delay_probe import main

    assert main(["--steps", "3", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 3
    for line in lines[1:]:
        got = {k: float(v) for k, v in re.findall(r"([\w/]+\*?)=(\S+)", line)}
        assert set(got) == {"dg/g", "lam*", "resid", "acco_est", "wp_est"}
        assert 0.0 <= got["resid"] <= 1.0 + 1e-6  # the best lambda (0 included) cannot do worse than none
        assert got["acco_est"] > 0 and got["wp_est"] > 0
