"""Unit tests for acco_loco.feedback against float64 references of the LoCo / EF rules."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from acco_loco.registry import make_codec
from acco_loco.feedback import ErrorFeedback, compress

EPS32 = torch.finfo(torch.float32).eps


def _inputs(steps: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # gradient-like: per-group magnitudes over 2 decades, a slowly drifting mean
    mag = 10.0 ** torch.empty(numel // 32, 1).uniform_(-1, 1, generator=g)
    drift = torch.randn(numel, generator=g)
    return [((torch.randn(numel // 32, 32, generator=g) * mag).view(-1) + 0.3 * drift) for _ in range(steps)]


def test_loco_fp32_matches_float64_reference_with_reset():
    numel, beta, period = 512, 0.8, 25
    codec = make_codec("int4", group_size=32)
    fb = ErrorFeedback("loco", numel, beta=beta, reset_period=period, storage="fp32", group_size=32)
    e_ref = torch.zeros(numel, dtype=torch.float64)
    resets = []
    for step, x in enumerate(_inputs(50, numel), start=1):
        h = fb.compensate(x)
        # h = x + e (one fp32 rounding of the float64 sum)
        assert ((h.double() - (x.double() + e_ref)).abs() <= EPS32 * h.abs().double() + 1e-6 * e_ref.abs().max()).all()
        payload, scales = codec.encode(h)
        sent = codec.decode(payload, scales)
        fb.update(h, sent)
        e_ref = beta * e_ref + (1 - beta) * (h.double() - sent.double())
        e = fb.error().double()
        assert e_ref.abs().max() > 0
        # fp32 arithmetic against the float64 formula: a few roundings per step, damped by
        # beta < 1, so a few ulps of the largest term; a misplaced beta would be off by O(|d|)
        d = h.double() - sent.double()
        assert ((e - e_ref).abs() <= 8 * EPS32 * (e_ref.abs().max() + d.abs().max())).all()
        if fb.on_committed_step(step):
            resets.append(step)
            e_ref.zero_()
            assert torch.equal(fb.error(), torch.zeros(numel))
            assert torch.equal(fb.compensate(x), x)
    assert resets == [25, 50]


def test_loco_int8_storage_within_half_a_step_of_the_formula():
    """int8 storage re-quantizes the new error with round-to-nearest and scale absmax/127 per
    group, so the stored error is within half an int8 step of that group's *own* scale of the
    formula applied to the previous stored error (which is what compensate added)."""
    numel, beta, group = 1024, 0.8, 64
    codec = make_codec("int2", group_size=128)  # the wire codec may use other groups
    fb = ErrorFeedback("loco", numel, beta=beta, reset_period=1000, storage="int8", group_size=group)
    assert fb.nbytes() == numel + 4 * numel // group  # 1 byte per value + fp32 scales
    for step, x in enumerate(_inputs(50, numel, seed=1), start=1):
        e_prev = fb.error().double()
        h = fb.compensate(x)
        # h = x + deQ8(e): one fp32 rounding of x + q*scale (fused multiply-add), and deQ8(e)
        # itself is q*scale rounded once
        assert ((h.double() - (x.double() + e_prev)).abs() <= EPS32 * (h.abs().double() + e_prev.abs())).all()
        payload, scales = codec.encode(h)
        sent = codec.decode(payload, scales)
        fb.update(h, sent)
        d = h.double() - sent.double()
        formula = beta * e_prev + (1 - beta) * d
        stored = fb.error().double()
        step8 = fb.state_dict()["e_scales"].double().repeat_interleave(group)
        # slack for the fp32 evaluation of the formula (d, beta*e, the sum: a few roundings)
        fp32_slack = 4 * EPS32 * (beta * e_prev.abs() + (1 - beta) * d.abs() + formula.abs())
        # the storage scale is absmax/127 of the (fp32-computed) formula ...
        amax = formula.view(-1, group).abs().amax(1).repeat_interleave(group)
        slack_max = fp32_slack.view(-1, group).amax(1).repeat_interleave(group)
        assert ((step8 - amax / 127).abs() <= (slack_max + EPS32 * amax) / 127).all()
        # ... and round-to-nearest keeps every stored value within half that step
        assert ((stored - formula).abs() <= step8 / 2 + fp32_slack).all()
        assert (stored != formula).any()  # storage is lossy: the bound is not vacuous
        fb.on_committed_step(step)


def test_classic_ef_sent_trails_meant_by_current_error():
    numel, steps = 256, 40
    codec = make_codec("int2", group_size=32)
    fb = ErrorFeedback("ef", numel, storage="fp32", group_size=32, reset_period=10_000)
    assert fb.beta == 0.0
    none = ErrorFeedback("none", numel)
    sum_sent = torch.zeros(numel, dtype=torch.float64)
    sum_sent_none = torch.zeros(numel, dtype=torch.float64)
    sum_meant = torch.zeros(numel, dtype=torch.float64)
    slack = torch.zeros(numel, dtype=torch.float64)
    for step, x in enumerate(_inputs(steps, numel, seed=2), start=1):
        _, _, sent = compress(x, codec, fb)
        _, _, sent_none = compress(x, codec, none)
        sum_sent += sent.double()
        sum_sent_none += sent_none.double()
        sum_meant += x.double()
        slack += 2 * EPS32 * (x.double().abs() + fb.error().double().abs() + sent.double().abs())
        fb.on_committed_step(step)
    e = fb.error().double()
    # telescoping: sum(sent) - sum(meant) = -e_T, up to the fp32 roundings of h = x + e, h - sent
    assert ((sum_sent - sum_meant + e).abs() <= slack).all()
    assert e.abs().max() > 1e3 * slack.max()  # the error is not trivially small
    # without feedback the quantization error accumulates: far outside that bound
    assert (sum_sent_none - sum_meant).abs().max() > 100 * slack.max()


def test_reset_counts_committed_steps_not_calls():
    numel = 128
    codec = make_codec("int4", group_size=32)
    fb = ErrorFeedback("loco", numel, reset_period=3, storage="int8", group_size=32)
    xs = _inputs(14, numel, seed=3)
    fired = []
    for step in range(1, 8):
        # two rounds per optimizer step (ACCO estimate + commit), each updating e
        compress(xs[2 * step - 2], codec, fb)
        compress(xs[2 * step - 1], codec, fb)
        assert fb.error().abs().max() > 0
        if fb.on_committed_step(step):
            fired.append(step)
            assert torch.equal(fb.error(), torch.zeros(numel))
        else:
            assert fb.error().abs().max() > 0
    assert fired == [3, 6]
    with pytest.raises(ValueError, match="step"):
        fb.on_committed_step(-1)


@pytest.mark.parametrize("storage", ["int8", "fp32"])
def test_state_dict_roundtrip_is_bit_exact(storage, tmp_path):
    numel = 256
    codec = make_codec("int4", group_size=64)
    kw = dict(beta=0.7, reset_period=5, storage=storage, group_size=64)
    fb = ErrorFeedback("loco", numel, **kw)
    xs = _inputs(10, numel, seed=4)
    for x in xs[:4]:
        compress(x, codec, fb)
    path = tmp_path / "fb.safetensors"
    save_file(fb.state_dict(), str(path))
    fb2 = ErrorFeedback("loco", numel, **kw)
    fb2.load_state_dict(load_file(str(path)))
    assert torch.equal(fb2.error(), fb.error()) and fb.error().abs().max() > 0
    for step, x in enumerate(xs[4:], start=5):  # crosses a reset at step 5
        p1, s1, _ = compress(x, codec, fb)
        p2, s2, _ = compress(x, codec, fb2)
        assert torch.equal(p1, p2) and torch.equal(s1, s2)
        assert fb.on_committed_step(step) == fb2.on_committed_step(step)
    assert torch.equal(fb2.error(), fb.error())


def test_load_state_dict_mismatch_raises():
    fb = ErrorFeedback("loco", 256, storage="int8", group_size=64)
    sd = fb.state_dict()
    with pytest.raises(ValueError, match="kind 'loco' vs 'ef'"):
        ErrorFeedback("ef", 256, storage="int8", group_size=64).load_state_dict(sd)
    with pytest.raises(ValueError, match="storage 'int8' vs 'fp32'"):
        ErrorFeedback("loco", 256, storage="fp32", group_size=64).load_state_dict(sd)
    with pytest.raises(ValueError, match="numel 256 vs 512"):
        ErrorFeedback("loco", 512, storage="int8", group_size=64).load_state_dict(sd)
    with pytest.raises(ValueError, match="group_size 64 vs 128"):
        ErrorFeedback("loco", 256, storage="int8", group_size=128).load_state_dict(sd)
    other_beta = ErrorFeedback("loco", 256, beta=0.5, storage="int8", group_size=64)
    with pytest.raises(ValueError, match="beta 0.8 vs 0.5"):
        other_beta.load_state_dict(sd)
    other_beta.load_state_dict(sd, strict=False)  # hyperparameters may change on purpose
    bad = dict(sd, e_scales=sd["e_scales"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="e_scales"):
        fb.load_state_dict(bad)
    with pytest.raises(ValueError, match="lacks 'e_codes'"):
        fb.load_state_dict({k: v for k, v in sd.items() if k != "e_codes"})
    with pytest.raises(ValueError, match="not an error-feedback state"):
        fb.load_state_dict({"e": torch.zeros(256)})


def test_kind_none_is_a_no_op():
    fb = ErrorFeedback("none", 100)  # no state: any size, no group constraint
    x = torch.randn(100)
    assert fb.compensate(x) is x
    fb.update(x, torch.zeros(100))
    assert torch.equal(fb.error(), torch.zeros(100))
    assert fb.nbytes() == 0 and set(fb.state_dict()) == {"config", "beta"}
    assert not fb.on_committed_step(1024)


def test_nan_leaves_state_untouched():
    codec = make_codec("int4", group_size=32)
    fb = ErrorFeedback("loco", 128, storage="int8", group_size=32)
    compress(torch.randn(128), codec, fb)
    before = {k: v.clone() for k, v in fb.state_dict().items()}
    x = torch.randn(128)
    x[5] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        compress(x, codec, fb)
    for k, v in fb.state_dict().items():
        assert torch.equal(v, before[k])


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\)"):
        ErrorFeedback("loco", 128, beta=1.0)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\)"):
        ErrorFeedback("loco", 128, beta=-0.1)
    with pytest.raises(ValueError, match="beta = 0"):
        ErrorFeedback("ef", 128, beta=0.5)
    with pytest.raises(ValueError, match="valid kinds: none, ef, loco"):
        ErrorFeedback("topk", 128)
    with pytest.raises(ValueError, match="valid storages: int8, fp32"):
        ErrorFeedback("loco", 128, storage="fp16")
    with pytest.raises(ValueError, match="reset_period must be an integer >= 1"):
        ErrorFeedback("loco", 128, reset_period=0)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        ErrorFeedback("loco", 100, storage="int8", group_size=32)
    fb = ErrorFeedback("loco", 128, storage="fp32")
    with pytest.raises(ValueError, match="128 values"):
        fb.compensate(torch.zeros(64))
    assert ErrorFeedback("loco", 128, beta=0.0).beta == 0.0  # loco with beta 0 == classic EF
    assert ErrorFeedback("loco", 128).beta == 0.8
