/* The fused CPU kernels of acco_loco/kernels.py (which says what each computes, bit for bit,
   and how this file is built and checked). */
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
