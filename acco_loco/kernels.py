"""Fused CPU kernels for the comm side's hot loops, in C (acco_loco/kernels.c), built through
torch.utils.cpp_extension and called through ctypes; each one computes, bit for bit, what the
torch code it replaces computes, in one pass over its buffer instead of a dozen.

Why: on CPU the torch path of a LoCo round is ~40 separate full-buffer passes (each op reads
and writes the whole buffer and allocates its result); here the work of one quantization group
(``group_size`` values) stays in L1 from the gradient read to the packed payload, the new error
state and the decoded values. benchmarks/round_cpu.py measures the difference.

Kernels (all on contiguous CPU fp32 / uint8 tensors, a whole number of groups):

* ``encode``: the gradient codec with error feedback (acco_loco/feedback.py ``compress`` with
  int8 error storage, over an int8/int4/int2 wire codec with fp32 scales and round-to-nearest):
  ``h = x / count + e``, quantize + pack ``h``, ``e = beta e + (1 - beta)(h - deQ(h))``
  re-quantized to int8, and whether ``x`` held a NaN/Inf;
* ``decode_sum``: ``out (+)= w * deQ(payload)`` (the shard owner's weighted sum of the rows);
* ``delta_encode`` / ``decode_add``: the int8/int4 parameter delta against what every replica
  holds, and ``held += deQ(delta)``;
* ``adamw``: acco_loco/adamw.py's step on a slice, from the reduced gradient sum (mean and
  clipping folded in); the square root stays torch's (its vectorized sqrt is not always the
  correctly rounded one, so C's would differ in the last bit).

Where torch fuses a multiply-add (``addcmul_``, ``add_(alpha=)``, ``lerp``: one rounding, FMA)
the kernel calls ``fmaf``; everywhere else it rounds each operation as torch does, compiled with
``-ffp-contract=off`` so that the compiler cannot fuse on its own. Non-finite inputs give the
same flags, scales and decisions as torch; the codes of a non-finite group (never used: the
step is skipped and the error state rolled back) may differ.

Building: the first use compiles the source below (C, in an ``extern "C"`` block) with
``torch.utils.cpp_extension.load`` (ninja and the C++ compiler torch is set up with; a pip
dependency and the system's g++) into a shared library cached under ``$ACCO_LOCO_KERNEL_CACHE``
(default ``~/.cache/acco_loco``), keyed by the source, the flags, the CPU (``-march=native``) and
the torch version; about 1.5 s. The C entry points are bound with ctypes. Then a
self-check runs every kernel against the torch code on a few random groups of every supported
shape and keeps the kernels only if all bits agree. Any failure (no compiler, a mismatch, an
unsupported codec) means the torch path, which stays the reference: nothing else changes.
``ACCO_LOCO_KERNELS=0`` turns the kernels off.

GPU nodes: where CUDA is available the kernels are not built (the training runs on the GPU, and
a ``-march=native`` build per node and torch version would only cost start-up time), unless asked
for explicitly (``ACCO_LOCO_KERNELS=1``, or ``use(True)``: CPU training or tests on a GPU node).
A kernel handed a tensor that is not on the CPU (CUDA, meta, fake) raises ``ValueError``, and a
null address (a meta tensor's ``data_ptr()``) too: neither reaches the C code, where it would be
a segfault. Callers that pass addresses (ints) rather than tensors check ``fits()`` first.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("acco_loco")

MAX_GROUP = 4096  # the kernels keep one group on the stack
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"]

_SOURCE = (Path(__file__).with_name("kernels.c")).read_text()  # C, built by _build

_lib = None
_state = "unbuilt"  # unbuilt | ready | off
_forced = False  # use(True): build even on a CUDA node
_lock = threading.Lock()


def _env() -> str:
    return os.environ.get("ACCO_LOCO_KERNELS", "").strip().lower()


def _cuda_node() -> bool:
    """Whether this process can see a CUDA device (then the CPU kernels are not built by default)."""
    return torch.cuda.is_available()


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return sys.platform


def _cache_dir() -> str:
    cache = os.environ.get("ACCO_LOCO_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "acco_loco")
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:  # no writable home: the temporary directory
        cache = os.path.join(tempfile.gettempdir(), f"acco_loco-{os.getuid() if hasattr(os, 'getuid') else 0}")
        os.makedirs(cache, exist_ok=True)
    return cache


def _build() -> ctypes.CDLL:
    """Compile the source through torch's extension builder (ninja and the C++ compiler torch
    is set up with; it locks the build directory, so concurrent processes build once), cached per
    source, flags, CPU and torch version; then bind the C entry points with ctypes."""
    from torch.utils import cpp_extension

    key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), _cpu_key(), torch.__version__]).encode()).hexdigest()[:20]
    build_dir = os.path.join(_cache_dir(), f"kernels-{key}")
    os.makedirs(build_dir, exist_ok=True)
    src = os.path.join(build_dir, "kernels.cpp")
    if not os.path.exists(src):
        tmp = f"{src}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write('extern "C" {\n' + _SOURCE + "\n}\n")  # plain C entry points, no name mangling
        os.replace(tmp, src)  # atomic: a peer process writing the same file meanwhile is harmless
    path = cpp_extension.load(name=f"acco_loco_kernels_{key}", sources=[src], extra_cflags=_FLAGS,
                              build_directory=build_dir, is_python_module=False, verbose=False)
    lib = ctypes.CDLL(path)
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.encode.argtypes = [p, i64, i64, i64, i32, i32, f32, i32, p, p, i32, i32, f32, f32, i32, p, i64, i64]
    lib.encode.restype = i32
    lib.decode_sum.argtypes = [p, i64, i64, i64, p, i64, i64, i32, i32, p]
    lib.decode_sum.restype = None
    lib.delta_encode.argtypes = [p, p, i64, i32, i32, p, i64]
    lib.delta_encode.restype = i32
    lib.decode_add.argtypes = [p, i64, i64, i64, i64, i32, i32, p, i64]
    lib.decode_add.restype = None
    lib.adamw_moments.argtypes = [p, i64, f32, i32, f32, p, p, p, p, f32, i32, f32, f32]
    lib.adamw_moments.restype = None
    lib.adamw_params.argtypes = [i64, p, p, p, p, f32, f32, f32, f32]
    lib.adamw_params.restype = None
    return lib


def available() -> bool:
    """Whether the kernels are built, loaded and agree with torch bit for bit on this machine."""
    global _lib, _state
    if _state == "unbuilt":
        with _lock:
            if _state == "unbuilt":
                if _env() in ("0", "off", "false", "no"):
                    _state = "off"
                elif _cuda_node() and not (_forced or _env() in ("1", "on", "true", "yes")):
                    _state = "off"
                    log.info("acco_loco: a CUDA node: the fused CPU kernels are not built (the torch path "
                             "serves CPU tensors); ACCO_LOCO_KERNELS=1 builds them anyway")
                else:
                    try:
                        _lib = _build()
                        from .kernel_check import self_check

                        problems = self_check(sys.modules[__name__])
                        if problems:
                            raise RuntimeError("they disagree with torch: " + "; ".join(problems))
                        _state = "ready"
                    except Exception as exc:  # the torch path is always there
                        _lib, _state = None, "off"
                        log.warning("acco_loco: fused CPU kernels unavailable (%s); using the torch path", exc)
    return _state == "ready"


def use(enabled: bool) -> None:
    """Turn the kernels off (the torch path everywhere), or on again (built and checked at the
    next use, unless ``ACCO_LOCO_KERNELS=0``; on a CUDA node too): for tests and comparisons. Collectives decide
    when they are built, so set this before building an engine."""
    global _lib, _state, _forced
    with _lock:
        _forced = enabled
        if enabled:
            if _state == "off":
                _state = "unbuilt"
        else:
            _lib, _state = None, "off"


def _check_cpu(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"the fused kernels are CPU code: {what} is a tensor on {t.device}; on a GPU "
                         "the torch path runs (check kernels.fits(t) before calling a kernel)")
    if not t.is_contiguous():
        raise ValueError(f"the fused kernels need contiguous tensors: {what} is not (.contiguous() first)")


def _ptr(t: torch.Tensor | None, what: str = "a tensor") -> int | None:
    if t is None:
        return None
    _check_cpu(t, what)
    return t.data_ptr()


def _addr(x, what: str) -> int | None:
    """The address a kernel reads or writes: a CPU tensor's data, or an int already computed
    from one. A non-CPU tensor or a null address raises instead of reaching the C code."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return _ptr(x, what)
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"{what}: a CPU tensor or its address (int), got {type(x).__name__}")
    if x == 0:
        raise ValueError(f"{what} is a null address (a meta tensor's data_ptr()?): the fused kernels "
                         "need CPU tensors with data")
    return x


def _groups(numel: int, group: int) -> int:
    if numel % group:
        raise ValueError(f"{numel} values are not a whole number of groups of {group}")
    return numel // group


# ------------------------------------------------------------------------ the calls
# Addresses are plain ints (tensor.data_ptr() plus byte offsets): a round computes them once per
# piece, and the kernels read and write nothing else. Strides and offsets count values of the
# float arrays (x, held) and bytes of the byte arrays (payload rows).
def encode(x: int, rows: int, x_stride: int, numel: int, count: float, bits: int, group: int, out: int,
           out_stride: int, scales_off: int, ecodes: int | None = None, escales: int | None = None,
           e_zero: bool = True, update: bool = True, beta: float = 0.0) -> bool:
    """Encode ``numel`` values of each of ``rows`` rows of fp32 ``x``, divided by ``count``
    (plus the int8 error state at ``ecodes``/``escales``, laid out like ``x``, which then moves
    on when ``update``), into payload + scales rows at ``out``; True when ``x`` held a NaN/Inf."""
    mode = 0 if ecodes is None else (1 if e_zero else 2)
    x, out = _addr(x, "x"), _addr(out, "out")
    ecodes, escales = _addr(ecodes, "ecodes"), _addr(escales, "escales")
    return bool(_lib.encode(x, rows, x_stride, _groups(numel, group), group, bits, float(count), int(count != 1),
                            ecodes, escales, mode, int(update), float(beta), float(1.0 - beta), int(beta == 0.0),
                            out, out_stride, scales_off))


def decode_sum(rows_at: int, rows: int, stride: int, scales_off: int, weights_at: int, w_stride: int,
               numel: int, bits: int, group: int, out: int) -> None:
    """``out`` (fp32, ``numel``) = sum over rows r in order of w_r * deQ(row r); the weights are
    fp32 bytes read by the kernel (never on the host)."""
    rows_at, weights_at, out = _addr(rows_at, "rows_at"), _addr(weights_at, "weights_at"), _addr(out, "out")
    _lib.decode_sum(rows_at, rows, stride, scales_off, weights_at, w_stride, _groups(numel, group), group, bits, out)


def delta_encode(new: int, held: int, numel: int, bits: int, group: int, out: int, scales_off: int) -> bool:
    """Q(new - held) into payload + scales at ``out``; every scale NaN (and True) if a delta is not finite."""
    new, held, out = _addr(new, "new"), _addr(held, "held"), _addr(out, "out")
    return bool(_lib.delta_encode(new, held, _groups(numel, group), group, bits, out, scales_off))


def decode_add(rows_at: int, rows: int, stride: int, scales_off: int, numel: int, bits: int, group: int,
               held: int, held_stride: int) -> None:
    """Row r of ``held`` (at ``held + 4 * r * held_stride``) += deQ(row r)."""
    rows_at, held = _addr(rows_at, "rows_at"), _addr(held, "held")
    _lib.decode_add(rows_at, rows, stride, scales_off, _groups(numel, group), group, bits, held, held_stride)


def adamw(grad_sum: torch.Tensor, count: int, coef: float, m: torch.Tensor, v: torch.Tensor, p: torch.Tensor,
          m_out: torch.Tensor, v_out: torch.Tensor, p_out: torch.Tensor, lr: float, step: int, spec,
          scratch: torch.Tensor) -> None:
    """adamw.propose on ``grad_sum / count`` (times ``coef`` when below 1), into the ``*_out``;
    ``scratch`` (as long) takes the square root of the new second moment (torch's sqrt gives
    the same bits whatever the slices: it is elementwise)."""
    for t, what in ((grad_sum, "grad_sum"), (m, "m"), (v, "v"), (p, "p"), (m_out, "m_out"), (v_out, "v_out"),
                    (p_out, "p_out"), (scratch, "scratch")):
        _check_cpu(t, what)
    beta1, beta2 = spec.betas
    w1 = 1 - beta1
    n = grad_sum.numel()
    _lib.adamw_moments(_ptr(grad_sum), n, float(count), int(coef < 1.0), float(coef), _ptr(m), _ptr(v),
                       _ptr(m_out), _ptr(v_out), float(w1), int(abs(ctypes.c_float(w1).value) < 0.5),
                       float(beta2), float(1 - beta2))
    torch.sqrt(v_out, out=scratch)
    _lib.adamw_params(n, _ptr(p), _ptr(m_out), _ptr(scratch), _ptr(p_out), float(1 - lr * spec.weight_decay),
                      float(math.sqrt(1 - beta2**step)), float(spec.eps), float(-lr / (1 - beta1**step)))


def fits(t: torch.Tensor) -> bool:
    """A tensor the kernels take: on the CPU and contiguous."""
    return t.device.type == "cpu" and t.is_contiguous()


# ------------------------------------------------------------------------ the self-check
