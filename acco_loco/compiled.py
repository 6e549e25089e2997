"""The round's encode + error feedback (acco_loco/feedback.py ``compress``, and the engine's
per-piece form ``compress_piece``: compensate, encode, update the error) compiled with torch.compile: on a GPU, Inductor turns its ~20 eager passes over
the buffer into a few Triton kernels. The same torch source as the eager path, so the payload's
bits are the eager ones where no floating-point sum changes order (the int codecs' max |x| per
group; tests/engine/test_compiled_codecs.py); the compensation ``h = x + q * scale`` may fuse the
multiply-add differently (one rounding), which every rank does alike.

``compress`` falls back to the eager code, once and for good, with a warning, when compiling fails
(no Triton, a graph break: ``fullgraph=True`` raises before anything ran, so the error state is
untouched). Stochastic rounding (a generator) stays eager. ACCO_LOCO_COMPILE=0 turns it off."""

from __future__ import annotations

import logging
import os

import torch

from .feedback import compress as eager_compress
from .feedback import compress_piece as eager_piece

log = logging.getLogger("acco_loco")

RECOMPILE_LIMIT = 64  # graphs of compress_piece per process
_compiled = None
_compiled_piece = None
failed: str | None = None  # why the compiled path was given up, once it was


def available(device: torch.device | str) -> bool:
    """Whether the engine compiles the encode + error feedback on ``device``: on CUDA with Triton,
    unless ACCO_LOCO_COMPILE=0 or an earlier compile failed."""
    if os.environ.get("ACCO_LOCO_COMPILE", "1") == "0" or failed is not None:
        return False
    if torch.device(device).type != "cuda":
        return False
    try:
        from torch.utils._triton import has_triton

        return has_triton()
    except ImportError:
        return False


def _body(x, codec, feedback, update: bool):
    return eager_compress(x, codec, feedback, None, update=update, check_finite=False)


def compress(x, codec, feedback, generator=None, *, update: bool = True, check_finite: bool = False):
    """``feedback.compress``'s ``(payload, scales, sent)``, compiled; eager for a generator, with
    ``check_finite`` (a host read), or once compiling failed."""
    global _compiled, failed
    if generator is not None or check_finite or failed is not None:
        return eager_compress(x, codec, feedback, generator, update=update, check_finite=check_finite)
    if _compiled is None:
        _compiled = torch.compile(_body, fullgraph=True, dynamic=False)
    try:
        return _compiled(x, codec, feedback, update)
    except Exception as exc:  # a compile error: nothing ran (one whole graph), the state is as it was
        failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning("acco_loco: compiling the encode + error feedback failed (%s); running the eager torch "
                    "code instead (same results, slower on a GPU)", failed)
        return eager_compress(x, codec, feedback, None, update=update, check_finite=False)


def compress_piece(x, codec, state, state_codec, beta: float, zero: bool, update: bool, generator=None):
    """``feedback.compress_piece`` compiled: what the engine's reducer runs on each piece of the
    buffer (``ErrorFeedback.in_pieces(..., run=compress_piece)``), so the compiled path keeps the
    pieced path's temporaries (one piece long). Pieces of one length share one compiled graph
    (the offset is not an argument: the state comes as views); eager for a generator or once
    compiling failed. A failed compile ran nothing, so that piece's state is untouched and the
    eager code takes it from there."""
    global _compiled_piece, failed
    if generator is not None or failed is not None or zero:
        # zero: the first round after a start, once: not worth a graph of its own (every graph
        # counts against Dynamo's recompile limit)
        return eager_piece(x, codec, state, state_codec, beta, zero, update, generator)
    if _compiled_piece is None:
        _compiled_piece = torch.compile(eager_piece, fullgraph=True, dynamic=False)
    try:
        try:
            return _compiled_piece(x, codec, state, state_codec, beta, zero, update)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # one graph per (codec, piece length, update): a run has a handful (the gradient and
            # the parameter codec, the last piece's length); past Dynamo's default 8 per function
            # the new graph is compiled under a higher limit (nothing ran: fullgraph raises before).
            # Only here: entering the patch costs ~0.1 ms, too much for every piece
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return _compiled_piece(x, codec, state, state_codec, beta, zero, update)
    except Exception as exc:
        failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning("acco_loco: compiling the encode + error feedback failed (%s); running the eager torch "
                    "code instead (same results, slower on a GPU)", failed)
        return eager_piece(x, codec, state, state_codec, beta, zero, update, None)


def reset() -> None:
    """Forget the compiled functions and any failure (tests)."""
    global _compiled, _compiled_piece, failed
    _compiled, _compiled_piece, failed = None, None, None
