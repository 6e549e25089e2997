"""The files of a low-bit export (``recipes/export.py``), and the loader of the packed model.

An export folder ``OUT`` (:func:`write_export`) holds:

    OUT/quantized/    quantized.safetensors: per quantized linear ``<name>.qweight`` (packed
                      codes), ``<name>.scales`` (float16) and ``<name>.zeros`` (uint8), and every
                      other tensor (embeddings, norms) unquantized, tied duplicates once; the
                      format description as safetensors metadata and as quantization.json;
                      config and tokenizer. ``load_quantized(OUT/quantized)`` rebuilds the model.
    OUT/dequantized/  the same model with float32 weights deQ(Q(W)), ``from_pretrained``-loadable
    OUT/adapter/      the low-rank residual as a PEFT LoRA adapter (lora_A = A, lora_B = B,
                      lora_alpha = r, so the scale is 1), for the de-quantized base (no adapter
                      at rank 0):
                          model = AutoModelForCausalLM.from_pretrained("OUT/dequantized")
                          model = PeftModel.from_pretrained(model, "OUT/adapter")

``acco_loco.weight_quant`` defines the codes and their packed layout; this module only stores
them.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator, Mapping, Protocol

import torch

from acco_loco.eora import LowRankResidual
from acco_loco.weight_quant import QuantizedWeight, QuantSpec, dequantize
from lm.models import save_pretrained_plain

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "PACKED_FILE",
    "QuantizedLayer",
    "installed",
    "load_quantized",
    "merged_weights",
    "model_bytes",
    "read_packed",
    "unique_state",
    "write_adapter",
    "write_dequantized",
    "write_export",
    "write_packed",
]

FORMAT = "acco-loco-rtn"
FORMAT_VERSION = "1"  # read_packed refuses any other version
PACKED_FILE = "quantized.safetensors"


class QuantizedLayer(Protocol):
    """What the writers read of one quantized linear (the recipe's ``LayerResult``); a protocol
    so that this module does not depend on the recipe."""

    packed: QuantizedWeight
    dequantized: torch.Tensor  # deQ(Q(W)), float32 (out, in)
    residuals: dict[str, LowRankResidual]  # by method: "eora", "svd"


def unique_state(model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict without tied duplicates, and ``{alias: name kept}`` for the dropped ones
    (SmolLM2's ``lm_head.weight`` is ``model.embed_tokens.weight``)."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    owner: dict[tuple[int, int, tuple], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in owner:
            aliases[name] = owner[key]
        else:
            owner[key] = name
            kept[name] = tensor
    return kept, aliases


@contextlib.contextmanager
def installed(linears: dict[str, torch.nn.Linear], weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """The given linears run with other weights inside the block; the originals come back after."""
    saved = {name: linears[name].weight.data for name in weights}
    try:
        for name, w in weights.items():
            linears[name].weight.data = w.to(saved[name].dtype)
        yield
    finally:
        for name, w in saved.items():
            linears[name].weight.data = w


def _save_config_and_tokenizer(model, tokenizer, folder: Path) -> None:
    model.config.save_pretrained(folder)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):  # ByteTokenizer has none
        tokenizer.save_pretrained(folder)


def write_packed(folder: Path, model, tokenizer, layers: Mapping[str, QuantizedLayer],
                 spec: QuantSpec) -> Path:
    """``folder/quantized.safetensors`` + ``quantization.json`` + config + tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state, aliases = unique_state(model)
    tensors = {k: v.detach().contiguous() for k, v in state.items()
               if k.removesuffix(".weight") not in layers}
    for name, layer in layers.items():
        tensors[f"{name}.qweight"] = layer.packed.qweight
        tensors[f"{name}.scales"] = layer.packed.scales
        tensors[f"{name}.zeros"] = layer.packed.zeros
    description = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "bits": spec.bits,
        "group_size": spec.group_size, "symmetric": spec.symmetric,
        "layout": "see acco_loco/weight_quant.py: per module <name>.qweight uint8 (out, padded_in*bits/8) "
                  "little-endian bit stream of codes per row; <name>.scales float16 and <name>.zeros "
                  "uint8 (out, padded_in/group_size); W = (code - zero) * scale, padding columns dropped",
        "modules": {name: list(layer.packed.shape) for name, layer in layers.items()},
        "tied": aliases,
    }
    # safetensors metadata holds strings only
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in description.items()}
    save_file(tensors, str(folder / PACKED_FILE), metadata=meta)
    (folder / "quantization.json").write_text(json.dumps(description, indent=2) + "\n")
    _save_config_and_tokenizer(model, tokenizer, folder)
    return folder


def read_packed(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """The float32 state dict a packed folder stands for (tied aliases left out), and its
    description."""
    from safetensors import safe_open

    folder = Path(folder)
    desc = json.loads((folder / "quantization.json").read_text())
    if desc.get("format") != FORMAT or str(desc.get("format_version")) != FORMAT_VERSION:
        raise ValueError(f"{folder} holds format {desc.get('format')!r} v{desc.get('format_version')}, "
                         f"this reader knows {FORMAT!r} v{FORMAT_VERSION}")
    spec = QuantSpec(int(desc["bits"]), int(desc["group_size"]), bool(desc["symmetric"]))
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(folder / PACKED_FILE), framework="pt") as f:
        keys = set(f.keys())
        for name, shape in desc["modules"].items():
            qw = QuantizedWeight(f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales"),
                                 f.get_tensor(f"{name}.zeros"), tuple(shape), spec)
            state[f"{name}.weight"] = dequantize(qw)
            keys -= {f"{name}.qweight", f"{name}.scales", f"{name}.zeros"}
        for key in keys:
            state[key] = f.get_tensor(key)
    return state, desc


def load_quantized(folder: str | os.PathLike):
    """Rebuild the de-quantized model (float32, eval mode) from a packed folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    state, desc = read_packed(folder)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in desc["tied"]]  # tie_weights fills those
    if missing or unexpected:
        raise ValueError(f"{folder}: missing {missing[:4]}, unexpected {unexpected[:4]} tensors")
    model.tie_weights()
    return model.float().eval()


def write_dequantized(folder: Path, model, tokenizer, linears: dict[str, torch.nn.Linear],
                      layers: Mapping[str, QuantizedLayer]) -> Path:
    weights = {name: layer.dequantized for name, layer in layers.items()}
    with installed(linears, weights):
        return save_pretrained_plain(model, tokenizer, folder)


def write_adapter(folder: Path, layers: Mapping[str, QuantizedLayer], method: str, rank: int,
                  dtype: torch.dtype, base: Path) -> Path:
    """A PEFT LoRA adapter holding ``B`` (lora_B) and ``A`` (lora_A) with scale
    ``lora_alpha / r = 1``, for the linears of ``layers``. ``OverflowError`` if the factors do
    not fit ``dtype``."""
    from safetensors.torch import save_file

    tensors = {}
    for name, layer in layers.items():
        b, a = layer.residuals[method].factors(rank, dtype)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise OverflowError(f"{name}: the rank-{rank} factors overflow {dtype}")
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "target_modules": sorted(layers), "inference_mode": True,
        "base_model_name_or_path": str(base.resolve()),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt", "method": method})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def write_export(out: Path, model, tokenizer, linears: dict[str, torch.nn.Linear],
                 layers: Mapping[str, QuantizedLayer], spec: QuantSpec, rank: int,
                 adapter_dtype: torch.dtype) -> dict[str, int]:
    """All three folders (the EoRA residual as the adapter); returns the bytes of every file
    under ``out``."""
    write_packed(out / "quantized", model, tokenizer, layers, spec)
    write_dequantized(out / "dequantized", model, tokenizer, linears, layers)
    if rank > 0:
        write_adapter(out / "adapter", layers, "eora", rank, adapter_dtype, out / "dequantized")
    return {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}


# The weights and sizes an export stands for, in memory: the recipe evaluates and sizes every
# bit width and rank without writing each one.


def merged_weights(layers: Mapping[str, QuantizedLayer], method: str | None, rank: int,
                   adapter_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``deQ(Q(W)) + B A`` per linear, with ``B``, ``A`` rounded to the adapter's dtype (what
    the written adapter holds); RTN alone when ``method`` is None or ``rank`` is 0."""
    out = {}
    for name, layer in layers.items():
        w = layer.dequantized
        if method is not None and rank > 0:
            b, a = layer.residuals[method].factors(rank, adapter_dtype)
            w = w + b.float() @ a.float()
        out[name] = w
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_bytes(model, linears: dict[str, torch.nn.Linear], layers: Mapping[str, QuantizedLayer],
                rank: int, adapter_dtype: torch.dtype) -> dict[str, int]:
    """Bytes of one configuration: packed weights + scales + zero points, the unquantized rest
    (embeddings, norms, biases, at the model's precision) and the adapter. With no linears and
    no layers: the unquantized model."""
    state, _ = unique_state(model)
    full = sum(_nbytes(t) for t in state.values())
    rest = full - sum(_nbytes(m.weight) for m in linears.values())
    packed = sum(layer.packed.nbytes for layer in layers.values())
    elem = torch.empty((), dtype=adapter_dtype).element_size()
    adapter = sum(rank * (m.in_features + m.out_features) * elem for m in linears.values())
    return {"packed_weights": packed, "unquantized_rest": rest, "adapter": adapter,
            "total": packed + rest + adapter}
