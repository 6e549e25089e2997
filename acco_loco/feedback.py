"""Error compensation on what a worker sends (pure tensor math).

Per worker and per communicated buffer, before quantization (LoCo: Xie et al., "LoCo:
Low-Bit Communication Adaptor for Large-scale Model Training", arXiv 2407.04480)::

    h = x + e                                   # x: what this round sends, e: error state
    q = Q(h)                                    # the wire codec
    e = beta * e + (1 - beta) * (h - deQ(q))    # moving average of the compression error
    every reset_period committed optimizer steps: e = 0

Kinds:

* ``"none"``: no compensation, ``e`` stays 0 (no state is allocated);
* ``"ef"``: classic error feedback, ``beta = 0``, so ``e = h - deQ(q)`` and what was not
  sent is re-sent next time (the sum of what was sent trails the sum of what was meant by
  exactly the current ``e``);
* ``"loco"``: the moving average above, ``beta = 0.8`` by default.

The error is stored in int8 with its own group-wise fp32 scales by default, as LoCo does
(``storage="int8"``: 1 byte per value plus 4 bytes per group), or in fp32
(``storage="fp32"``, exact, for tests and debugging).  With int8 storage the new error is
re-quantized with round-to-nearest after each update, so the stored error is within half an
int8 step (``absmax(e_group) / 127 / 2``) of the formula applied to the previous stored error.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import Tensor

from .codecs import Codec
from .int_codec import IntCodec

__all__ = ["FEEDBACK_KINDS", "ERROR_STORAGES", "ErrorFeedback", "compress", "compress_piece"]

FEEDBACK_KINDS: tuple[str, ...] = ("none", "ef", "loco")
ERROR_STORAGES: tuple[str, ...] = ("int8", "fp32")
_DEFAULT_BETA = {"none": 0.0, "ef": 0.0, "loco": 0.8}
_STATE_FORMAT = 1  # bump when the state_dict layout changes


class ErrorFeedback:
    """Error state ``e`` for one flat buffer of ``numel`` values.

    Typical use per communication round::

        h = fb.compensate(x)                 # x + e (fp32)
        payload, scales = codec.encode(h)
        fb.update(h, codec.decode(payload, scales))
        ...
        fb.on_committed_step(step)           # after optimizer step `step` (1, 2, ...) commits

    or :func:`compress`, which does the three lines above.
    """

    def __init__(
        self,
        kind: str,
        numel: int,
        *,
        beta: float | None = None,
        reset_period: int = 1024,
        storage: str = "int8",
        group_size: int = 128,
        device: torch.device | str | None = None,
    ) -> None:
        if kind not in FEEDBACK_KINDS:
            raise ValueError(f"unknown error-feedback kind {kind!r}; valid kinds: {', '.join(FEEDBACK_KINDS)}")
        if storage not in ERROR_STORAGES:
            raise ValueError(f"unknown error storage {storage!r}; valid storages: {', '.join(ERROR_STORAGES)}")
        if beta is None:
            beta = _DEFAULT_BETA[kind]
        beta = float(beta)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1) (got {beta})")
        if kind == "ef" and beta != 0.0:
            raise ValueError(f"classic error feedback (kind='ef') has beta = 0 (got {beta}); use kind='loco' for beta > 0")
        if kind == "none" and beta != 0.0:
            raise ValueError(f"kind='none' keeps no error state, beta must be left unset (got {beta})")
        if isinstance(reset_period, bool) or not isinstance(reset_period, int) or reset_period < 1:
            raise ValueError(f"reset_period must be an integer >= 1 (got {reset_period!r})")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be an integer >= 0 (got {numel!r})")
        self.kind = kind
        self.numel = numel
        self.beta = beta
        self.reset_period = reset_period
        self.storage = storage
        self.group_size = group_size
        # normalized ("cuda" -> "cuda:0") so that it compares equal to tensor.device
        self.device = torch.empty(0, device=device).device
        self._codec: Codec | None = None
        self._e: Tensor | None = None  # fp32 storage
        self._codes: Tensor | None = None  # int8 storage: offset-binary codes
        self._scales: Tensor | None = None  # int8 storage: fp32 group scales
        self._zero = True  # e is known to be exactly 0 (fresh or just reset): skip the decode
        self._marked: list[Tensor] | None = None  # mark()'s copy of the error tensors
        self._marked_zero = True
        if kind == "none":
            return
        if storage == "fp32":
            self._e = torch.zeros(numel, dtype=torch.float32, device=self.device)
        else:
            self._codec = IntCodec(name="int8", bits=8, group_size=group_size, scale_dtype=torch.float32)
            groups = self._codec.payload_bytes(numel) // group_size  # validates numel % group_size
            self._codes = torch.full((numel,), 128, dtype=torch.uint8, device=self.device)  # q = 0
            self._scales = torch.zeros(groups, dtype=torch.float32, device=self.device)

    # -- the rule ---------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """False for kind ``"none"`` (compensate returns its input, update does nothing)."""
        return self.kind != "none"

    def _check(self, t: Tensor, what: str, at: int | None = None) -> None:
        """``at`` None: ``t`` is the whole buffer; else values ``[at, at + len(t))`` of it."""
        if at is None and (t.dim() != 1 or t.numel() != self.numel):
            raise ValueError(f"{what} must be a 1-D tensor of {self.numel} values (got shape {tuple(t.shape)})")
        grouped = self._codes is not None  # int8 storage: a piece holds whole groups of its scales
        if at is not None and (t.dim() != 1 or at < 0 or at + t.numel() > self.numel
                               or (grouped and (at % self.group_size or t.numel() % self.group_size))):
            raise ValueError(f"{what}: a piece must be 1-D, end by value {self.numel} and (int8 storage) start "
                             f"at a multiple of group_size {self.group_size} and hold whole groups "
                             f"(got {tuple(t.shape)} at {at})")
        if t.device != self.device:
            raise ValueError(f"{what} is on {t.device} but the error state is on {self.device}")

    def error(self) -> Tensor:
        """The current error ``e`` as a new fp32 tensor (zeros for kind ``"none"``)."""
        if self._e is not None:
            return self._e.clone()
        if self._codec is not None and not self._zero:
            return self._codec.decode(self._codes, self._scales)
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def _state(self, at: int, n: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The error state of values ``[at, at + n)``: (fp32 e, int8 codes, their scales), views."""
        g = self.group_size
        part = (lambda t: None if t is None else t[at:at + n])
        scales = None if self._scales is None else self._scales[at // g:(at + n) // g]
        return part(self._e), part(self._codes), scales

    def compensate(self, x: Tensor) -> Tensor:
        """``h = x + e`` as a new fp32 tensor.  For kind ``"none"`` returns ``x`` itself (no copy)."""
        self._check(x, "x")
        return self._compensate(x.to(torch.float32, copy=True) if self.active else x, 0, self._zero)

    def _compensate(self, h: Tensor, at: int, zero: bool) -> Tensor:
        """``h += e`` in place on fp32 ``h`` (values ``[at, at + len(h))``, whole groups);
        ``zero``: e is known to be 0."""
        if not self.active:
            return h
        return _compensate(h, self._state(at, h.numel()), self._codec, zero)

    def update(self, h: Tensor, sent: Tensor) -> None:
        """``e = beta*e + (1-beta)*(h - sent)`` where ``sent = deQ(Q(h))`` (fp32)."""
        if not self.active:
            return
        self._check(h, "h")
        self._check(sent, "sent")
        self._absorb(torch.sub(h, sent).to(torch.float32), 0, self._zero)
        self._zero = False

    def _absorb(self, d: Tensor, at: int, zero: bool) -> None:
        """The update for this round's compression error ``d = h - sent`` (fp32, overwritten) of
        values ``[at, at + len(d))`` (whole groups); ``zero``: e was known to be 0."""
        _absorb(d, self._state(at, d.numel()), self._codec, self.beta, zero)

    @contextmanager
    def in_pieces(self, codec: Codec, generator: torch.Generator | None = None, *, update: bool = True,
                  run: Callable | None = None):
        """One pass of :func:`compress` over the buffer in pieces, for memory: yields
        ``piece(x, at) -> (payload, scales)``, which compensates, encodes and (``update``) moves
        the error of values ``[at, at + len(x))`` (whole groups; each value once per pass), with
        temporaries of the piece's size only; ``x``: fp32, the caller's own (it is overwritten
        with the compensated values). Every step is per group, so the pieces give the
        bits of one whole-buffer ``compress``; stochastic rounding draws its uniforms in call
        order, so pieces taken in buffer order draw what the whole would on the CPU (CUDA's
        counter-based generator draws other, equally uniform, values). The pass never checks
        finiteness (the engine's round does); "known to be zero" is the pass's start state.
        ``run``: what computes a piece, :func:`compress_piece`'s signature (acco_loco/compiled.py
        passes its compiled form); default the eager function."""
        zero, run = self._zero, run or compress_piece

        def piece(x: Tensor, at: int) -> tuple[Tensor, Tensor]:
            self._check(x, "x", at)
            if not self.active:
                return codec.encode(x, generator, check_finite=False)
            return run(x, codec, self._state(at, x.numel()), self._codec, self.beta, zero, update, generator)

        yield piece
        if update and self.active:
            self._zero = False

    @contextmanager
    def lent_to_kernel(self, lend: bool, update: bool):
        """Lend ``(codes, scales, zero)`` of the int8 storage, live, to a fused kernel that
        compensates (and, with ``update``, writes the new error) in place (acco_loco/kernels.py);
        ``(None, None, True)`` when nothing is lent (``lend`` False, or no error is kept). After
        an update the state is no longer known to be 0: this object keeps that true."""
        if not (lend and self.active):
            yield None, None, True
            return
        if self._codes is None:
            raise ValueError(f"the error state is stored as {self.storage!r}, not int8")
        yield self._codes, self._scales, self._zero
        if update:
            self._zero = False

    def on_committed_step(self, step: int) -> bool:
        """Call once after optimizer step ``step`` (the count of committed steps, 1-based)
        commits; resets ``e`` to 0 when ``step % reset_period == 0``.  Returns whether it did.

        Counted in committed optimizer steps, not in rounds, calls or tensors."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0 (got {step!r})")
        if self.active and step % self.reset_period == 0:
            self.reset()
            return True
        return False

    def mark(self) -> None:
        """Remember the current error state, for :meth:`rollback` (one copy of the state,
        kept between calls so that marking every step allocates nothing)."""
        if not self.active:
            return
        live = [t for t in (self._e, self._codes, self._scales) if t is not None]
        if self._marked is None:
            self._marked = [t.clone() for t in live]
        else:
            for saved, t in zip(self._marked, live):
                saved.copy_(t)
        self._marked_zero = self._zero

    @property
    def marked(self) -> bool:
        """Whether a :meth:`mark` is held (what :meth:`rollback` goes back to)."""
        return self._marked is not None

    def forget_mark(self) -> None:
        """Drop the mark and its copy (a later :meth:`mark` allocates it again)."""
        self._marked = None
        self._marked_zero = True

    def rollback(self) -> None:
        """Go back to the state of the last :meth:`mark`: what a skipped optimizer step sent
        must not leave an error behind (the step never happened)."""
        if not self.active:
            return
        if self._marked is None:
            raise RuntimeError("rollback() without a mark(): nothing to go back to")
        live = [t for t in (self._e, self._codes, self._scales) if t is not None]
        for saved, t in zip(self._marked, live):
            t.copy_(saved)
        self._zero = self._marked_zero

    def mark_state_dict(self) -> dict[str, Tensor]:
        """The marked state (for a checkpoint taken between the two rounds of an ACCO step,
        where a later rollback still needs it); empty when nothing is marked."""
        if self._marked is None:
            return {}
        names = [k for k, t in (("e", self._e), ("e_codes", self._codes), ("e_scales", self._scales)) if t is not None]
        out = dict(zip(names, (t.detach() for t in self._marked)))
        out["zero"] = torch.tensor([self._marked_zero])
        return out

    def load_mark_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`mark_state_dict` returned (same configuration)."""
        self.mark()  # allocates the copy with the right shapes
        names = [k for k, t in (("e", self._e), ("e_codes", self._codes), ("e_scales", self._scales)) if t is not None]
        for saved, name in zip(self._marked, names):
            if name not in state or state[name].shape != saved.shape or state[name].dtype != saved.dtype:
                raise ValueError(f"marked error-feedback state lacks a matching {name!r}")
            saved.copy_(state[name])
        self._marked_zero = bool(state["zero"].reshape(-1)[0])

    def reset(self) -> None:
        """Set ``e = 0``."""
        if self._e is not None:
            self._e.zero_()
        if self._codes is not None:
            self._codes.fill_(128)
            self._scales.zero_()
        self._zero = True

    # -- checkpointing ------------------------------------------------------------------------

    def _config(self) -> list[int]:
        return [
            _STATE_FORMAT,
            FEEDBACK_KINDS.index(self.kind),
            ERROR_STORAGES.index(self.storage),
            self.numel,
            self.group_size,
            self.reset_period,
        ]

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only (safetensors-ready): ``config`` (int64: format, kind, storage, numel,
        group_size, reset_period), ``beta`` (float64) and the error: ``e`` (fp32 storage) or
        ``e_codes`` + ``e_scales`` (int8 storage).  The error tensors are the live state (like
        ``nn.Module.state_dict``): clone them before mutating."""
        d = {
            "config": torch.tensor(self._config(), dtype=torch.int64),
            "beta": torch.tensor([self.beta], dtype=torch.float64),
        }
        if self._e is not None:
            d["e"] = self._e.detach()
        if self._codes is not None:
            d["e_codes"] = self._codes.detach()
            d["e_scales"] = self._scales.detach()
        return d

    def load_state_dict(self, state: dict[str, Tensor], strict: bool = True) -> None:
        """Restore from :meth:`state_dict`, bit-exactly.  Raises ``ValueError`` when the
        checkpoint was written with another kind, storage, size or group size (or, with
        ``strict``, another beta or reset period; ``strict=False`` lets those change)."""
        if "config" not in state or "beta" not in state:
            raise ValueError(f"not an error-feedback state: keys {sorted(state)} lack 'config'/'beta'")
        cfg = [int(v) for v in state["config"].reshape(-1).tolist()]
        if len(cfg) != 6 or cfg[0] != _STATE_FORMAT:
            raise ValueError(f"error-feedback state has format {cfg[:1]}, this code reads format {_STATE_FORMAT}")
        _, kind_i, storage_i, numel, group_size, reset_period = cfg
        saved_beta = float(state["beta"].reshape(-1)[0])
        problems = []
        if not 0 <= kind_i < len(FEEDBACK_KINDS) or FEEDBACK_KINDS[kind_i] != self.kind:
            saved = FEEDBACK_KINDS[kind_i] if 0 <= kind_i < len(FEEDBACK_KINDS) else kind_i
            problems.append(f"kind {saved!r} vs {self.kind!r}")
        if not 0 <= storage_i < len(ERROR_STORAGES) or ERROR_STORAGES[storage_i] != self.storage:
            saved = ERROR_STORAGES[storage_i] if 0 <= storage_i < len(ERROR_STORAGES) else storage_i
            problems.append(f"storage {saved!r} vs {self.storage!r}")
        if numel != self.numel:
            problems.append(f"numel {numel} vs {self.numel}")
        if group_size != self.group_size:
            problems.append(f"group_size {group_size} vs {self.group_size}")
        if strict and reset_period != self.reset_period:
            problems.append(f"reset_period {reset_period} vs {self.reset_period}")
        if strict and saved_beta != self.beta:
            problems.append(f"beta {saved_beta} vs {self.beta}")
        if problems:
            raise ValueError("error-feedback state does not match this configuration (checkpoint vs now): " + "; ".join(problems))

        def take(key: str, like: Tensor) -> Tensor:
            if key not in state:
                raise ValueError(f"error-feedback state lacks {key!r}")
            t = state[key]
            if t.dtype != like.dtype or t.shape != like.shape:
                raise ValueError(
                    f"error-feedback state {key!r} is {t.dtype} {tuple(t.shape)}, expected {like.dtype} {tuple(like.shape)}"
                )
            return t

        if self._e is not None:
            self._e.copy_(take("e", self._e))
        if self._codes is not None:
            codes, scales = take("e_codes", self._codes), take("e_scales", self._scales)
            self._codes.copy_(codes)
            self._scales.copy_(scales)
        self._zero = not self.active

    def nbytes(self) -> int:
        """Memory held by the error state (a mark()'s copy doubles it)."""
        return sum(t.numel() * t.element_size() for t in (self._e, self._codes, self._scales) if t is not None)

    def __repr__(self) -> str:
        return (
            f"ErrorFeedback(kind={self.kind!r}, numel={self.numel}, beta={self.beta}, "
            f"reset_period={self.reset_period}, storage={self.storage!r}, group_size={self.group_size}, "
            f"device={str(self.device)!r})"
        )


def compress(
    x: Tensor, codec: Codec, feedback: ErrorFeedback, generator: torch.Generator | None = None,
    *, update: bool = True, check_finite: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Compensate, encode and update in one call: returns ``(payload, scales, sent)`` where
    ``sent = deQ(payload, scales)`` (fp32).  If ``encode`` raises (NaN/Inf), the error state
    is left untouched; ``update=False`` leaves it untouched too (a worker with nothing to send
    keeps its error for the next round)."""
    h = feedback.compensate(x)
    payload, scales, sent = codec.encode_with_decoded(h, generator, check_finite=check_finite)
    if update:
        feedback.update(h, sent)
    return payload, scales, sent


# -- one piece's arithmetic, on explicit views of the state (what acco_loco/compiled.py compiles) --

State = tuple[Tensor | None, Tensor | None, Tensor | None]  # views: (fp32 e, int8 codes, their scales)


def _compensate(h: Tensor, state: State, state_codec: Codec | None, zero: bool) -> Tensor:
    """``h += e`` in place on fp32 ``h``; ``zero``: e is known to be 0."""
    e, codes, scales = state
    if e is not None:
        return h.add_(e)
    if not zero:
        # h += q * scale in one pass (fused multiply-add where the backend has one)
        state_codec.decode(codes, scales, out=h, accumulate=True)
    return h


def _absorb(d: Tensor, state: State, state_codec: Codec | None, beta: float, zero: bool) -> None:
    """Move the state to ``beta * e + (1 - beta) * d`` for this round's compression error
    ``d = h - sent`` (fp32, overwritten); ``zero``: e was known to be 0."""
    e, codes, scales = state
    if e is not None:
        if beta == 0.0:
            e.copy_(d)
        else:
            e.mul_(beta).add_(d, alpha=1.0 - beta)
        return
    if beta == 0.0 or zero:
        new = d.mul_(1.0 - beta) if beta else d
    else:
        new = state_codec.decode(codes, scales)
        new.mul_(beta).add_(d, alpha=1.0 - beta)
    # Non-finite h was already refused by the wire codec's encode.
    new_codes, new_scales = state_codec.encode(new, check_finite=False)
    codes.copy_(new_codes)
    scales.copy_(new_scales)


def compress_piece(x: Tensor, codec: Codec, state: State, state_codec: Codec | None, beta: float, zero: bool,
                   update: bool, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """:func:`compress` on one piece, the error state given as views of its values: compensate
    ``x`` in place, encode, and (``update``) write the new error into ``state``."""
    h = _compensate(x, state, state_codec, zero)
    payload, scales, sent = codec.encode_with_decoded(h, generator, check_finite=False)
    if update:
        d = h.sub_(sent)  # the compression error, in h's memory
        del sent  # before the error's re-encode makes its own temporaries
        _absorb(d, state, state_codec, beta, zero)
    return payload, scales
