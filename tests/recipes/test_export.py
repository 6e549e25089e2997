"""Low-bit export: the group-wise quantizer against a float64 reference, the packed format, and
recipes/export.py end to end on a tiny random Llama (export with lm.quantized_files, reload
through transformers + peft and load_quantized, logits match; EoRA lowers the
calibration-weighted output error)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from acco_loco.weight_quant import (
    MIN_SCALE,
    QuantSpec,
    dequantize,
    pack_codes,
    quantize_codes,
    quantize_weight,
    unpack_codes,
)

# ------------------------------------------------------------------ quantizer


def _reference(w: torch.Tensor, spec: QuantSpec):
    """One group at a time, in float64 with Python scalars where it matters."""
    out, cols = w.shape
    n_groups = math.ceil(cols / spec.group_size)
    padded = torch.zeros(out, n_groups * spec.group_size, dtype=torch.float64)
    padded[:, :cols] = w.double()
    codes = torch.zeros(out, n_groups, spec.group_size, dtype=torch.uint8)
    scales = torch.zeros(out, n_groups, dtype=torch.float16)
    zeros = torch.zeros(out, n_groups, dtype=torch.uint8)
    for r, g in itertools.product(range(out), range(n_groups)):
        group = padded[r, g * spec.group_size:(g + 1) * spec.group_size]
        if spec.symmetric:
            raw = float(group.abs().max()) / (2 ** (spec.bits - 1) - 1)
        else:
            raw = (max(float(group.max()), 0.0) - min(float(group.min()), 0.0)) / (2**spec.bits - 1)
        s16 = np.float16(max(raw, MIN_SCALE))
        if float(s16) < max(raw, MIN_SCALE):  # round up: the next float16
            s16 = np.nextafter(s16, np.float16(np.inf))
        s = float(s16)
        if spec.symmetric:
            z = 2 ** (spec.bits - 1)
        else:
            z = min(max(round(-min(float(group.min()), 0.0) / s), 0), 2**spec.bits - 1)
        q = torch.clamp(torch.round(group / s) + z, 0, 2**spec.bits - 1)
        codes[r, g], scales[r, g], zeros[r, g] = q.to(torch.uint8), float(s16), z
    return codes, scales, zeros


@pytest.mark.parametrize("bits,symmetric,cols", [(4, False, 96), (3, False, 80), (4, True, 64),
                                                 (3, True, 72), (2, False, 64), (8, False, 40)])
def test_quantizer_matches_float64_reference_and_half_step_bound(bits, symmetric, cols):
    g = torch.Generator().manual_seed(bits + cols)
    w = torch.randn(12, cols, generator=g) * torch.logspace(-3, 0, 12)[:, None]  # rows of all scales
    w[0, :16] = 0.0  # an all-zero group
    w[1] = w[1].abs()  # an all-positive row: 0 stays representable
    spec = QuantSpec(bits=bits, group_size=16, symmetric=symmetric)
    codes, scales, zeros = quantize_codes(w, spec)
    ref_codes, ref_scales, ref_zeros = _reference(w, spec)
    assert scales.dtype == torch.float16 and zeros.dtype == codes.dtype == torch.uint8
    assert torch.equal(scales, ref_scales) and torch.equal(zeros, ref_zeros)
    assert torch.equal(codes, ref_codes)
    assert int(codes.max()) < 2**bits

    qw = quantize_weight(w, spec)
    deq = dequantize(qw)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    step = scales.float().repeat_interleave(16, dim=1)[:, :cols]
    err = (w.double() - deq.double()).abs()
    assert torch.all(err <= step.double() / 2 * (1 + 1e-9)), float((err / step).max())
    assert torch.all(deq[0, :16] == 0)
    # packed size: bits per weight (of the padded row) + one float16 scale and one zero per group
    n_groups = math.ceil(cols / 16)
    assert qw.qweight.shape == (12, n_groups * 16 * bits // 8)
    assert qw.nbytes == 12 * (n_groups * 16 * bits // 8 + 3 * n_groups)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_packing_round_trip_and_bit_order(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, 48), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 48 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)
    # little-endian bit stream: code k sits at stream bits [k*bits, (k+1)*bits)
    stream = int.from_bytes(bytes(packed[0].tolist()), "little")
    assert [(stream >> (k * bits)) & (2**bits - 1) for k in range(48)] == codes[0].tolist()
    if bits == 4:  # two codes per byte, low nibble first
        assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 1]) << 4


def test_quantizer_input_checks():
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=1)
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantSpec(group_size=12)
    with pytest.raises(ValueError, match="NaN"):
        quantize_codes(torch.tensor([[math.nan] * 8]), QuantSpec(group_size=8))
    with pytest.raises(ValueError, match="whole bytes"):
        pack_codes(torch.zeros(2, 3, dtype=torch.uint8), 3)


# ------------------------------------------------------------------ recipes/export.py end to end

pytest.importorskip("transformers")

from acco_loco.eora import svd_residual, weighted_error  # noqa: E402
from lm.data import ByteTokenizer, load_text_documents, split_heldout, tokenize_documents  # noqa: E402
from lm.models import tiny_llama  # noqa: E402
from lm.quantized_files import (  # noqa: E402
    FORMAT,
    PACKED_FILE,
    installed,
    load_quantized,
    merged_weights,
    write_export,
)
from recipes import export as E  # noqa: E402
from tests.texts import text_folder  # noqa: E402


def _tiny_export(tmp_path, bits: int, rank: int):
    """Calibrate, quantize, compensate and write the tiny Llama; returns what the checks need."""
    data = text_folder(tmp_path / "text")
    cfg = E.ExportConfig(model=E.TINY_MODEL, dataset=str(data), bits=[bits], ranks=[rank],
                         calib_samples=24, calib_seq_len=64, progress=False)
    model, tok = tiny_llama(0), ByteTokenizer()
    train, _ = split_heldout(load_text_documents(str(data)))
    linears, groups, grams, windows = E.calibrate(cfg, model, tokenize_documents(train, tok), E.Timings())
    gram_copy = {key: acc.gram.clone() for key, acc in grams.items()}
    spec = QuantSpec(bits, cfg.group_size)
    results, _ = E.compensate_model(linears, groups, grams, [spec], ("eora",), [rank],
                                    cfg.eig_floor, E.Timings(), False)
    out = tmp_path / "out"
    write_export(out, model, tok, linears, results[bits], spec, rank, torch.float16)
    return model, linears, groups, gram_copy, results[bits], windows, out


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_export_reloads_through_transformers_and_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model, linears, groups, _, layers, windows, out = _tiny_export(tmp_path, bits=3, rank=8)
    assert len(linears) == 14 and len(groups) == 8  # q/k/v and gate/up share their input
    assert sorted(map(len, groups)) == [1, 1, 1, 1, 2, 2, 3, 3]
    ids = windows[:2]
    with installed(linears, merged_weights(layers, "eora", 8, torch.float16)):
        in_memory = _logits(model, ids)
    with installed(linears, merged_weights(layers, None, 0, torch.float16)):
        rtn = _logits(model, ids)

    base = AutoModelForCausalLM.from_pretrained(out / "dequantized")
    torch.testing.assert_close(_logits(base, ids), rtn, rtol=0, atol=1e-5)
    with_adapter = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    lora = [m for m in with_adapter.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(lora) == len(linears) and all(m.scaling["default"] == 1.0 for m in lora)
    torch.testing.assert_close(_logits(with_adapter, ids), in_memory, rtol=0, atol=1e-4)
    assert float((in_memory - rtn).abs().max()) > 1e-3  # the adapter is not a no-op

    # the packed folder alone rebuilds the same de-quantized model
    torch.testing.assert_close(_logits(load_quantized(out / "quantized"), ids), rtn, rtol=0, atol=1e-5)
    with safe_open(str(out / "quantized" / PACKED_FILE), framework="pt") as f:
        meta = f.metadata()
        q = f.get_tensor("model.layers.0.mlp.down_proj.qweight")  # (64, 160 -> 192 padded)
    assert meta["format"] == FORMAT and meta["bits"] == "3" and meta["group_size"] == "64"
    assert q.dtype == torch.uint8 and q.shape == (64, 192 * 3 // 8)


def test_eora_lowers_the_calibration_weighted_output_error(tmp_path):
    model, linears, groups, grams, layers, windows, _ = _tiny_export(tmp_path, bits=3, rank=8)
    leader = {name: g[0] for g in groups for name in g}
    for name, layer in layers.items():
        w = linears[name].weight.detach().double()
        gram = grams[leader[name]]
        rtn = weighted_error(w - layer.dequantized.double(), gram)
        b, a = layer.residuals["eora"].factors(8, torch.float64)
        eora = weighted_error(w - layer.dequantized.double() - b @ a, gram)
        svd = weighted_error(w - layer.dequantized.double() - svd_residual(
            w - layer.dequantized.double(), 8).product(8), gram)
        assert eora < 0.9 * rtn and eora <= svd * (1 + 1e-9), name
    # ... and the whole model's outputs on the calibration text move closer to fp32
    ids = windows[:8]
    ref = _logits(model, ids)
    errors = {}
    for method, rank in (("rtn", 0), ("eora", 8)):
        weights = merged_weights(layers, None if method == "rtn" else method, rank, torch.float16)
        with installed(linears, weights):
            errors[method] = float((_logits(model, ids) - ref).pow(2).mean())
    assert errors["eora"] < 0.8 * errors["rtn"], errors


def test_cli_report_table_and_plot(tmp_path):
    data = text_folder(tmp_path / "text")
    out, png = tmp_path / "out", tmp_path / "ppl.png"
    argv = ["--model", E.TINY_MODEL, "--dataset", str(data), "--bits", "4", "3", "--ranks", "8", "4",
            "--ablation", "svd", "--calib-samples", "16", "--calib-seq-len", "64", "--eval-samples",
            "6", "--eval-seq-len", "64", "--output-dir", str(out), "--plot", str(png), "--no-progress"]
    assert E.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    rows = {r["label"]: r for r in report["rows"]}
    assert len(rows) == 1 + 2 * (1 + 2 * 2) and png.stat().st_size > 0
    assert report["eval"]["sequences"] == 6 and report["eval"]["documents"] == ["doc2"]
    for bits in (4, 3):
        for rank in (4, 8):  # EoRA is the weighted optimum, so it beats SVD on this measure
            eora, svd = rows[f"{bits}-bit + EoRA r{rank}"], rows[f"{bits}-bit + SVD r{rank}"]
            assert eora["rel_output_error"] < svd["rel_output_error"]
            assert eora["bytes"]["adapter"] == svd["bytes"]["adapter"] > 0
        rtn = rows[f"{bits}-bit RTN"]
        assert rtn["bytes"]["total"] < rows["fp32"]["bytes"]["total"] / 2
        assert rtn["rel_output_error"] > rows[f"{bits}-bit + EoRA r8"]["rel_output_error"]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == adapter["lora_alpha"] == 8 and len(adapter["target_modules"]) == 14
    assert report["export_seconds"] > 0 and "quantized/quantized.safetensors" in report["files"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert E.main(["--model", E.TINY_MODEL, "--bits", "9", "--report", str(tmp_path / "r.json")]) == 2
    assert "bits must be an integer in 2..8" in capsys.readouterr().err
    assert E.main(["--model", E.TINY_MODEL]) == 2
    assert "nothing to write" in capsys.readouterr().err


def test_cli_rtn_only_export_has_no_adapter(tmp_path):
    data = text_folder(tmp_path / "text")
    out = tmp_path / "out"
    argv = ["--model", E.TINY_MODEL, "--dataset", str(data), "--bits", "4", "--ranks", "0",
            "--calib-samples", "8", "--calib-seq-len", "32", "--eval-samples", "0",
            "--output-dir", str(out), "--no-progress"]
    assert E.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert [r["method"] for r in report["rows"]] == ["fp32", "rtn"] and report["eval"] is None
    assert (out / "quantized" / PACKED_FILE).is_file() and (out / "dequantized" / "config.json").is_file()
    assert not (out / "adapter").exists()


def test_library_errors_become_one_line_recipe_errors(tmp_path):
    """lm.calibration and lm.quantized_files raise builtin exceptions; the recipe turns the user
    errors among them into ExportError (one line, exit status 2)."""
    from types import SimpleNamespace

    from lm.calibration import block_linears, calibration_windows
    from lm.models import tiny_gpt2
    from lm.quantized_files import write_adapter

    gpt2 = tiny_gpt2(n_layer=1, n_embd=32, n_head=2, n_positions=64)
    with pytest.raises(TypeError, match="Conv1D"):
        block_linears(gpt2)
    with pytest.raises(ValueError, match="fewer than one calibration window"):
        calibration_windows(torch.arange(10), 4, 16, seed=0)
    cfg = E.ExportConfig(model=E.TINY_MODEL, calib_samples=4, calib_seq_len=16, progress=False)
    with pytest.raises(E.ExportError, match="Conv1D"):
        E.calibrate(cfg, gpt2, torch.arange(100), E.Timings())
    with pytest.raises(E.ExportError, match="calibration window"):
        E.calibrate(cfg, tiny_llama(0), torch.arange(10), E.Timings())

    huge = SimpleNamespace(residuals={"eora": svd_residual(torch.full((4, 8), 1e12), 2)})
    with pytest.raises(OverflowError, match="overflow torch.float16"):
        write_adapter(tmp_path / "adapter", {"x": huge}, "eora", 2, torch.float16, tmp_path)
