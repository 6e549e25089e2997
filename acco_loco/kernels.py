"""Fused CPU kernels for the comm side's hot loops, in C, built with the system's C compiler
and called through ctypes; each one computes, bit for bit, what the torch code it replaces
computes, in one pass over its buffer instead of a dozen.

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
shape and keeps the kernels only if all bits agree. Any failure (no compiler, a mismatch, a
non-CPU tensor, an unsupported codec) means the torch path, which stays the reference: nothing
else changes. ``ACCO_LOCO_KERNELS=0`` turns the kernels off.
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

import torch

log = logging.getLogger("acco_loco")

MAX_GROUP = 4096  # the kernels keep one group on the stack
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"]

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Every loop below is a plain loop over one group held in L1, written so that the compiler can
   vectorize it (no calls, no data-dependent branches inside). */

#define MAXG 4096
static const float TINY = 1.17549435082228750797e-38f; /* 2**-126 */
typedef uint32_t u32a __attribute__((may_alias));
typedef float f32a __attribute__((may_alias));

/* torch's float -> int8 conversion of an integral float (cvttss2si, low byte): the slow path of
   a non-finite group */
static inline int8_t to_i8(float y) {
    int32_t t = fabsf(y) < 2147483648.0f ? (int32_t)y : INT32_MIN;
    return (int8_t)(uint8_t)(t & 0xFF);
}

/* largest |v| as fp32 bits (finite values order like their bits; above 0x7f800000: a NaN) */
static inline uint32_t absmax_bits(const float *v, int g) {
    const u32a *b = (const u32a *)v;
    uint32_t m = 0;
    for (int i = 0; i < g; i++) {
        uint32_t a = b[i] & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

/* offset-binary B-bit codes q + 2**(B-1), packed 8/B to a byte, code k of a byte in bits [kB, (k+1)B) */
static inline void pack(const int8_t *q, int g, int bits, uint8_t *p) {
    if (bits == 8) {
        for (int i = 0; i < g; i++) p[i] = (uint8_t)q[i] ^ 0x80;
    } else if (bits == 4) {
        for (int i = 0; i < g / 2; i++)
            p[i] = (uint8_t)((((uint8_t)q[2 * i] ^ 0x08) & 0x0F) | ((((uint8_t)q[2 * i + 1] ^ 0x08) & 0x0F) << 4));
    } else {
        for (int i = 0; i < g / 4; i++)
            p[i] = (uint8_t)((((uint8_t)q[4 * i] ^ 0x02) & 3) | ((((uint8_t)q[4 * i + 1] ^ 0x02) & 3) << 2)
                             | ((((uint8_t)q[4 * i + 2] ^ 0x02) & 3) << 4) | ((((uint8_t)q[4 * i + 3] ^ 0x02) & 3) << 6));
    }
}

/* the signed codes of a packed group */
static inline void unpack(const uint8_t *p, int g, int bits, int8_t *q) {
    if (bits == 8) {
        for (int i = 0; i < g; i++) q[i] = (int8_t)(p[i] ^ 0x80);
    } else if (bits == 4) {
        for (int i = 0; i < g / 2; i++) {
            q[2 * i] = (int8_t)((p[i] & 0x0F) - 8);
            q[2 * i + 1] = (int8_t)((p[i] >> 4) - 8);
        }
    } else {
        for (int i = 0; i < g / 4; i++) {
            q[4 * i] = (int8_t)((p[i] & 3) - 2);
            q[4 * i + 1] = (int8_t)(((p[i] >> 2) & 3) - 2);
            q[4 * i + 2] = (int8_t)(((p[i] >> 4) & 3) - 2);
            q[4 * i + 3] = (int8_t)((p[i] >> 6) - 2);
        }
    }
}

/* IntCodec._encode_groups on one group: packed codes, the scale, and deQ when dec != 0.
   Returns the scale; *absmax gets the largest |v| as bits (above 0x7f7fffff: not finite). */
static inline float quantize(const float *v, int g, int bits, uint8_t *packed, float *dec, uint32_t *absmax) {
    uint32_t mb = absmax_bits(v, g);
    *absmax = mb;
    float amax;
    if (mb > 0x7f800000u) amax = NAN;
    else { uint32_t t = mb; memcpy(&amax, &t, 4); }
    float qmax = (float)((1 << (bits - 1)) - 1);
    float scale = 0.0f;
    if (amax > 0) {
        scale = amax / qmax;
        if (scale < TINY) scale = TINY;
    }
    float safe = scale > 0 ? scale : 1.0f;
    int8_t q[MAXG];
    if (mb < 0x7f800000u) { /* finite: |v / safe| <= qmax, the codes are in range */
        if (dec) {
            for (int i = 0; i < g; i++) {
                float y = rintf(v[i] / safe);
                dec[i] = y * scale;
                q[i] = (int8_t)(int32_t)y;
            }
        } else {
            for (int i = 0; i < g; i++) q[i] = (int8_t)(int32_t)rintf(v[i] / safe);
        }
    } else {
        for (int i = 0; i < g; i++) {
            float y = rintf(v[i] / safe);
            if (dec) dec[i] = y * scale;
            q[i] = to_i8(y);
        }
    }
    pack(q, g, bits, packed);
    return scale;
}

/* compress() over `groups` groups: x (fp32) / count + e -> payload + scales; e moves on.
   e_mode: 0 no error feedback, 1 feedback with e == 0, 2 feedback with e live.
   Returns 1 when x holds a NaN or an Inf. */
static int encode_row(const float *x, int64_t groups, int g, int bits, float count, int divide,
                      uint8_t *ecodes, float *escales, int e_mode, int update, float beta, float alpha,
                      int beta_zero, uint8_t *payload, float *scales) {
    float h[MAXG], dec[MAXG], e[MAXG];
    int8_t q[MAXG];
    int bad = 0;
    int64_t pbytes = (int64_t)g * bits / 8;
    for (int64_t k = 0; k < groups; k++) {
        const float *xk = x + k * g;
        uint8_t *ec = ecodes ? ecodes + k * g : 0;
        float es = escales ? escales[k] : 0.0f;
        if (e_mode == 2) {
            unpack(ec, g, 8, q);
            if (divide)
                for (int i = 0; i < g; i++) h[i] = fmaf((float)q[i], es, xk[i] / count);
            else
                for (int i = 0; i < g; i++) h[i] = fmaf((float)q[i], es, xk[i]);
        } else if (divide) {
            for (int i = 0; i < g; i++) h[i] = xk[i] / count;
        } else {
            memcpy(h, xk, (size_t)g * sizeof(float));
        }
        int fb = e_mode != 0 && update;
        uint32_t hmax, emax;
        scales[k] = quantize(h, g, bits, payload + k * pbytes, fb ? dec : 0, &hmax);
        /* a NaN/Inf in x shows in h; only then look at x itself (h may also overflow alone) */
        if (hmax >= 0x7f800000u) bad |= absmax_bits(xk, g) >= 0x7f800000u;
        if (!fb) continue;
        if (beta_zero) {
            for (int i = 0; i < g; i++) e[i] = h[i] - dec[i];
        } else if (e_mode == 1) {
            for (int i = 0; i < g; i++) e[i] = (h[i] - dec[i]) * alpha;
        } else {
            for (int i = 0; i < g; i++) e[i] = fmaf(h[i] - dec[i], alpha, ((float)q[i] * es) * beta);
        }
        escales[k] = quantize(e, g, 8, ec, 0, &emax);
    }
    return bad;
}

/* encode_row for `rows` rows of x (row r at x + r * x_stride values; its error state alike);
   row r's payload at out + r * out_stride bytes, its scales `scales_off` bytes further */
int encode(const float *x, int64_t rows, int64_t x_stride, int64_t groups, int g, int bits, float count,
           int divide, uint8_t *ecodes, float *escales, int e_mode, int update, float beta, float alpha,
           int beta_zero, uint8_t *out, int64_t out_stride, int64_t scales_off) {
    int bad = 0;
    for (int64_t r = 0; r < rows; r++)
        bad |= encode_row(x + r * x_stride, groups, g, bits, count, divide,
                          ecodes ? ecodes + r * x_stride : 0, escales ? escales + r * (x_stride / g) : 0,
                          e_mode, update, beta, alpha, beta_zero, out + r * out_stride,
                          (float *)(out + r * out_stride + scales_off));
    return bad;
}

/* out = sum over rows r (in order) of w_r * deQ(row r): torch's mul (exact rounding) then
   addcmul_ (one FMA) per row; row r's payload at in + r * stride, its scales `scales_off` bytes
   further, its weight (fp32, maybe not word-aligned) at weights + r * w_stride */
void decode_sum(const uint8_t *in, int64_t rows, int64_t stride, int64_t scales_off, const uint8_t *weights,
                int64_t w_stride, int64_t groups, int g, int bits, float *out) {
    int8_t q[MAXG];
    int64_t pbytes = (int64_t)g * bits / 8;
    for (int64_t r = 0; r < rows; r++) {
        float w;
        memcpy(&w, weights + r * w_stride, sizeof w);
        const uint8_t *payload = in + r * stride;
        const float *scales = (const float *)(in + r * stride + scales_off);
        for (int64_t k = 0; k < groups; k++) {
            unpack(payload + k * pbytes, g, bits, q);
            float s = scales[k];
            float *o = out + k * g;
            if (r == 0)
                for (int i = 0; i < g; i++) o[i] = fmaf((float)q[i] * s, w, 0.0f);
            else
                for (int i = 0; i < g; i++) o[i] = fmaf((float)q[i] * s, w, o[i]);
        }
    }
}

/* the delta new - held, quantized into out (payload, then the scales `scales_off` bytes further);
   every scale NaN when some delta is not finite. Returns 1 in that case. */
int delta_encode(const float *newp, const float *held, int64_t groups, int g, int bits,
                 uint8_t *out, int64_t scales_off) {
    float d[MAXG];
    uint32_t dmax = 0;
    int64_t pbytes = (int64_t)g * bits / 8;
    float *scales = (float *)(out + scales_off);
    for (int64_t k = 0; k < groups; k++) {
        uint32_t m;
        for (int i = 0; i < g; i++) d[i] = newp[k * g + i] - held[k * g + i];
        scales[k] = quantize(d, g, bits, out + k * pbytes, 0, &m);
        dmax = m > dmax ? m : dmax;
    }
    int bad = dmax >= 0x7f800000u;
    if (bad)
        for (int64_t k = 0; k < groups; k++) scales[k] = NAN;
    return bad;
}

/* held row r (at held + r * held_stride values) += deQ(row r of in), the product rounded first */
void decode_add(const uint8_t *in, int64_t rows, int64_t stride, int64_t scales_off, int64_t groups, int g,
                int bits, float *held, int64_t held_stride) {
    int8_t q[MAXG];
    int64_t pbytes = (int64_t)g * bits / 8;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *payload = in + r * stride;
        const float *scales = (const float *)(in + r * stride + scales_off);
        float *hr = held + r * held_stride;
        for (int64_t k = 0; k < groups; k++) {
            unpack(payload + k * pbytes, g, bits, q);
            float s = scales[k];
            float *o = hr + k * g;
            for (int i = 0; i < g; i++) {
                float v = (float)q[i] * s;
                o[i] = o[i] + v;
            }
        }
    }
}

/* acco_loco/adamw.py propose() on n values, from the reduced sum: grad = sum / count (* coef).
   First the moments; torch.sqrt of the new second moment (its vectorized sqrt is not always the
   correctly rounded one, so it stays torch's); then the parameters. */
void adamw_moments(const float *gsum, int64_t n, float count, int clip, float coef,
                   const float *m_in, const float *v_in, float *m_out, float *v_out,
                   float w1, int small, float beta2, float one_m_beta2) {
    float c = clip ? coef : 1.0f;
    /* x / 2**k and x * 2**-k are both the correctly rounded x 2**-k: the multiply is exact */
    int pow2 = count > 0 && count == ldexpf(1.0f, ilogbf(count));
    float inv = pow2 ? 1.0f / count : 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float gr = pow2 ? gsum[i] * inv : gsum[i] / count;
        if (clip) gr = gr * c;
        float m = m_in[i];
        m_out[i] = small ? fmaf(w1, gr - m, m) : fmaf(w1 - 1.0f, gr - m, gr);
        v_out[i] = fmaf(one_m_beta2 * gr, gr, v_in[i] * beta2);
    }
}

void adamw_params(int64_t n, const float *p_in, const float *m_new, const float *sqrt_v, float *p_out,
                  float decay, float bc2s, float eps, float step) {
    for (int64_t i = 0; i < n; i++) {
        float denom = sqrt_v[i] / bc2s + eps;
        p_out[i] = p_in[i] * decay + (step * m_new[i]) / denom;
    }
}
"""

_lib = None
_state = "unbuilt"  # unbuilt | ready | off
_lock = threading.Lock()


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
                if os.environ.get("ACCO_LOCO_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
                    _state = "off"
                else:
                    try:
                        _lib = _build()
                        problems = _self_check()
                        if problems:
                            raise RuntimeError("they disagree with torch: " + "; ".join(problems))
                        _state = "ready"
                    except Exception as exc:  # the torch path is always there
                        _lib, _state = None, "off"
                        log.warning("acco_loco: fused CPU kernels unavailable (%s); using the torch path", exc)
    return _state == "ready"


def use(enabled: bool) -> None:
    """Turn the kernels off (the torch path everywhere), or on again (built and checked at the
    next use, unless ``ACCO_LOCO_KERNELS=0``): for tests and comparisons. Collectives decide
    when they are built, so set this before building an engine."""
    global _lib, _state
    with _lock:
        if enabled:
            if _state == "off":
                _state = "unbuilt"
        else:
            _lib, _state = None, "off"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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
    return bool(_lib.encode(x, rows, x_stride, _groups(numel, group), group, bits, float(count), int(count != 1),
                            ecodes, escales, mode, int(update), float(beta), float(1.0 - beta), int(beta == 0.0),
                            out, out_stride, scales_off))


def decode_sum(rows_at: int, rows: int, stride: int, scales_off: int, weights_at: int, w_stride: int,
               numel: int, bits: int, group: int, out: int) -> None:
    """``out`` (fp32, ``numel``) = sum over rows r in order of w_r * deQ(row r); the weights are
    fp32 bytes read by the kernel (never on the host)."""
    _lib.decode_sum(rows_at, rows, stride, scales_off, weights_at, w_stride, _groups(numel, group), group, bits, out)


def delta_encode(new: int, held: int, numel: int, bits: int, group: int, out: int, scales_off: int) -> bool:
    """Q(new - held) into payload + scales at ``out``; every scale NaN (and True) if a delta is not finite."""
    return bool(_lib.delta_encode(new, held, _groups(numel, group), group, bits, out, scales_off))


def decode_add(rows_at: int, rows: int, stride: int, scales_off: int, numel: int, bits: int, group: int,
               held: int, held_stride: int) -> None:
    """Row r of ``held`` (at ``held + 4 * r * held_stride``) += deQ(row r)."""
    _lib.decode_add(rows_at, rows, stride, scales_off, _groups(numel, group), group, bits, held, held_stride)


def adamw(grad_sum: torch.Tensor, count: int, coef: float, m: torch.Tensor, v: torch.Tensor, p: torch.Tensor,
          m_out: torch.Tensor, v_out: torch.Tensor, p_out: torch.Tensor, lr: float, step: int, spec,
          scratch: torch.Tensor) -> None:
    """adamw.propose on ``grad_sum / count`` (times ``coef`` when below 1), into the ``*_out``;
    ``scratch`` (as long) takes the square root of the new second moment (torch's sqrt gives
    the same bits whatever the slices: it is elementwise)."""
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
def _self_check() -> list[str]:
    """Every kernel against the torch code it replaces, on random data: the names that differ."""
    from .adamw import propose as torch_adamw
    from .codecs import make_codec
    from .feedback import ErrorFeedback, compress
    from .optim import OptimizerSpec
    from .shard_state import ShardState

    problems = []
    gen = torch.Generator().manual_seed(1234)
    for group in (8, 128):
        n = 32 * group
        for bits in (8, 4, 2):
            codec = make_codec(f"int{bits}", group_size=group)
            pb, sb = n * bits // 8, n // group
            for beta, count in ((0.8, 1), (0.8, 3), (0.0, 2)):
                kind = "loco" if beta else "ef"
                fb = ErrorFeedback(kind, n, beta=beta if beta else None, group_size=group)
                codes, scl = fb._codes.clone(), fb._scales.clone()
                zero = True
                for it in range(3):
                    x = torch.randn(n, generator=gen) * (10.0 ** (it - 1))
                    x[:group] = 0.0  # an all-zero group
                    want_p, want_s, _ = compress(x / count, codec, fb, check_finite=False)
                    got = torch.empty(2, (pb + sb * 4) // 2, dtype=torch.uint8)  # 2 rows of half the values
                    bad = encode(x.data_ptr(), 2, n // 2, n // 2, count, bits, group, got.data_ptr(), got.shape[1],
                                 pb // 2, codes.data_ptr(), scl.data_ptr(), zero, True, beta)
                    zero = False
                    got_p = got[:, :pb // 2].reshape(-1)
                    got_s = got[:, pb // 2:].contiguous().view(torch.float32).reshape(-1)
                    if bad or not (torch.equal(got_p, want_p) and torch.equal(got_s, want_s)
                                   and torch.equal(codes, fb._codes) and torch.equal(scl, fb._scales)):
                        problems.append(f"encode int{bits} group {group} beta {beta} count {count} round {it}")
                        break
            x = torch.randn(n, generator=gen)
            x[5] = float("nan")
            want_p, want_s = codec.encode(x, check_finite=False)
            got = torch.empty(pb + sb * 4, dtype=torch.uint8)
            bad = encode(x.data_ptr(), 1, n, n, 1, bits, group, got.data_ptr(), got.numel(), pb)
            if not bad or not torch.equal(got[pb:].view(torch.float32), want_s):
                problems.append(f"encode int{bits} without feedback: the NaN flag or the scales")
            x[5] = 0.0
            want_p, want_s = codec.encode(x)
            bad = encode(x.data_ptr(), 1, n, n, 1, bits, group, got.data_ptr(), got.numel(), pb)
            if bad or not (torch.equal(got[:pb], want_p) and torch.equal(got[pb:].view(torch.float32), want_s)):
                problems.append(f"encode int{bits} without feedback")
            # the owner's weighted sum of three rows
            want = torch.zeros(n)
            part = torch.empty(n)
            rows = torch.empty(3, pb + sb * 4 + 4, dtype=torch.uint8)
            for j, w in enumerate((1.0, 3.0, 0.5)):
                p, s = codec.encode(torch.randn(n, generator=gen))
                codec.decode(p, s, out=part)
                want.addcmul_(part, torch.tensor(w))
                rows[j, :pb], rows[j, pb:pb + 4 * sb] = p, s.view(torch.uint8)
                rows[j, pb + 4 * sb:] = torch.tensor([w]).view(torch.uint8)
            got = torch.empty(n)
            decode_sum(rows.data_ptr(), 3, rows.shape[1], pb, rows.data_ptr() + pb + 4 * sb, rows.shape[1], n, bits,
                       group, got.data_ptr())
            if not torch.equal(got, want):
                problems.append(f"decode_sum int{bits} group {group}")
            # the parameter delta and its install
            if bits in (8, 4):
                held = torch.randn(n, generator=gen)
                new = held + 1e-3 * torch.randn(n, generator=gen)
                delta = new - held
                want_p, want_s = codec.encode(delta, check_finite=False)
                got = torch.empty(pb + sb * 4, dtype=torch.uint8)
                bad = delta_encode(new.data_ptr(), held.data_ptr(), n, bits, group, got.data_ptr(), pb)
                if bad or not (torch.equal(got[:pb], want_p) and torch.equal(got[pb:].view(torch.float32), want_s)):
                    problems.append(f"delta_encode int{bits} group {group}")
                want_h, got_h = held.clone(), held.clone()
                want_h.add_(codec.decode(want_p, want_s))
                decode_add(got.data_ptr(), 1, got.numel(), pb, n, bits, group, got_h.data_ptr(), n)
                if not torch.equal(got_h, want_h):
                    problems.append(f"decode_add int{bits} group {group}")
    n = 4096 + 8  # a tail past the last whole vector
    for betas, wd, coef, count in (((0.9, 0.999), 0.0, 1.0, 1), ((0.8, 0.95), 0.1, 0.37, 3), ((0.3, 0.99), 0.01, 1.0, 2),
                                    ((0.9, 0.999), 0.0, 0.5, 8)):
        spec = OptimizerSpec(betas=betas, weight_decay=wd)
        master = torch.randn(n, generator=gen)
        state = ShardState(master, 0.01 * torch.randn(n, generator=gen), 1e-4 * torch.rand(n, generator=gen), step=4)
        gsum = torch.randn(n, generator=gen)
        grad = gsum / count
        if coef < 1.0:
            grad.mul_(coef)
        want = torch_adamw(state, grad, 1e-3, spec)
        outs = [torch.empty(n) for _ in range(3)]
        adamw(gsum, count, coef, state.exp_avg, state.exp_avg_sq, state.master, *outs, 1e-3, state.step + 1, spec,
              torch.empty(n))
        if not all(torch.equal(a, b) for a, b in zip(outs, (want.exp_avg, want.exp_avg_sq, want.master))):
            problems.append(f"adamw betas {betas}")
    return problems
