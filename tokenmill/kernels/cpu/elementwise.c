/* RMSNorm (with the residual add), SiLU-and-mul and RoPE on CPU, one pass each (called by elementwise.py).
 *
 * Their PyTorch code (tokenmill/layers/layernorm.py, activation.py, rotary.py)
 * is the reference, and these loops round where it rounds: bfloat16 results
 * are its bits except where RMSNorm's float32 sum of squares, added in another
 * order, moves one by an ulp; float32 ones differ in the last bits (sum order,
 * the polynomial exp). NaN payloads may differ:
 *
 *   add + RMSNorm (Zhang & Sennrich 2019), activation dtype T:
 *     s = T(x + residual)                          -> residual_out
 *     y = T(s * 1 / sqrt(mean(s^2) + eps))         (float32 mean)
 *     out = T(w * y)            (gemma: out = T(s / sqrt(...) * (1 + w)), one rounding)
 *   SiLU-and-mul (Shazeer 2020): out = T(T(g / (1 + e^-g)) * u), [g | u] = x
 *   RoPE, neox style (Su et al. 2021; rotary.py forward_torch), c = T(cos), s = T(sin) of the position:
 *     out[:h] = T(T(x1 * c) - T(x2 * s)),  out[h:] = T(T(x2 * c) + T(x1 * s)),  [x1 | x2] = a head
 *
 *   KV-cache write (vLLM's reshape_and_cache for a 16/32-bit cache): k_cache[slot] = k, v_cache[slot] = v,
 *     a copy of each token's row (no rounding); slot -1 (padding) is skipped
 *
 * T(.) rounds float32 to bfloat16 (nearest even) for bfloat16 tensors and is
 * the identity for float32; e^x is simd.h's vector polynomial. Rows are shared by OpenMP threads
 * (torch's libgomp) when a call has at least PARALLEL_MIN elements.
 */
#include "simd.h"

#include <string.h>

#define PARALLEL_MIN 32768

/* One row of add + RMSNorm; residual may be NULL (then s = x and residual_out is not written). */
static void rms_norm_row(const void *x, const void *residual, void *residual_out, void *out, const void *weight,
                         int64_t cols, float eps, int gemma, int is_bf16) {
#if defined(TM_AVX512)
    __m512 sq = _mm512_setzero_ps();
    for (int64_t i = 0; i < cols; i += 16) {
        const __mmask16 m = tail_mask(cols - i);
        __m512 s = load16(x, i, is_bf16, m);
        if (residual != NULL)
            s = store16(residual_out, i, _mm512_add_ps(s, load16(residual, i, is_bf16, m)), is_bf16, m);
        sq = _mm512_fmadd_ps(s, s, sq);
    }
    const float inv = 1.f / sqrtf(_mm512_reduce_add_ps(sq) / (float)cols + eps);
    const void *src = residual != NULL ? residual_out : x;
    for (int64_t i = 0; i < cols; i += 16) {
        const __mmask16 m = tail_mask(cols - i);
        const __m512 y = _mm512_mul_ps(load16(src, i, is_bf16, m), _mm512_set1_ps(inv));
        const __m512 w = load16(weight, i, is_bf16, m);
        if (gemma) {
            store16(out, i, _mm512_mul_ps(y, _mm512_add_ps(w, _mm512_set1_ps(1.f))), is_bf16, m);
        } else {
            const __m512 yr = is_bf16 ? round_bf16_v(y) : y;
            store16(out, i, _mm512_mul_ps(w, yr), is_bf16, m);
        }
    }
#else
    float sq = 0.f;
    for (int64_t i = 0; i < cols; i++) {
        float s = load1(x, i, is_bf16);
        if (residual != NULL) s = store1(residual_out, i, s + load1(residual, i, is_bf16), is_bf16);
        sq += s * s;
    }
    const float inv = 1.f / sqrtf(sq / (float)cols + eps);
    const void *src = residual != NULL ? residual_out : x;
    for (int64_t i = 0; i < cols; i++) {
        const float y = load1(src, i, is_bf16) * inv, w = load1(weight, i, is_bf16);
        if (gemma) {
            store1(out, i, y * (w + 1.f), is_bf16);
        } else {
            const float yr = is_bf16 ? bf16_to_f32(f32_to_bf16(y)) : y;
            store1(out, i, w * yr, is_bf16);
        }
    }
#endif
}

/* x [rows, cols] (row stride x_stride elements), residual / residual_out / out [rows, cols] with their own
 * row strides (residual NULL: plain RMSNorm), weight [cols] in the same dtype. All bfloat16 or all float32. */
void rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride, void *residual_out,
              int64_t res_out_stride, void *out, int64_t out_stride, const void *weight, int64_t rows, int64_t cols,
              float eps, int gemma, int is_bf16, int num_threads) {
    const int64_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row((const char *)x + r * x_stride * es,
                     residual != NULL ? (const char *)residual + r * res_stride * es : NULL,
                     residual != NULL ? (char *)residual_out + r * res_out_stride * es : NULL,
                     (char *)out + r * out_stride * es, weight, cols, eps, gemma, is_bf16);
}

/* x [rows, 2d] = [gate | up] (row stride x_stride elements), out [rows, d] (row stride out_stride). */
void silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t rows, int64_t d,
                  int is_bf16, int num_threads) {
    const int64_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)x + r * x_stride * es, *u = g + d * es;
        char *o = (char *)out + r * out_stride * es;
#if defined(TM_AVX512)
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = tail_mask(d - i);
            const __m512 gv = load16(g, i, is_bf16, m);
            __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp_v(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            if (is_bf16) s = round_bf16_v(s);
            store16(o, i, _mm512_mul_ps(s, load16(u, i, is_bf16, m)), is_bf16, m);
        }
#else
        for (int64_t i = 0; i < d; i++) {
            const float gv = load1(g, i, is_bf16);
            float s = gv / (1.f + expf(-gv));
            if (is_bf16) s = bf16_to_f32(f32_to_bf16(s));
            store1(o, i, s * load1(u, i, is_bf16), is_bf16);
        }
#endif
    }
}

/* One head of neox-style RoPE: x [2h] -> out [2h] with the position's cos / sin rows [h] (float32). */
static inline void rope_head(const void *x, void *out, const float *cos, const float *sin, int64_t h, int is_bf16) {
#if defined(TM_AVX512)
    for (int64_t i = 0; i < h; i += 16) {
        const __mmask16 m = tail_mask(h - i);
        __m512 c = _mm512_maskz_loadu_ps(m, cos + i), s = _mm512_maskz_loadu_ps(m, sin + i);
        if (is_bf16) {
            c = round_bf16_v(c);
            s = round_bf16_v(s);
        }
        const __m512 x1 = load16(x, i, is_bf16, m), x2 = load16(x, i + h, is_bf16, m);
        __m512 a = _mm512_mul_ps(x1, c), b = _mm512_mul_ps(x2, s);
        __m512 d = _mm512_mul_ps(x2, c), e = _mm512_mul_ps(x1, s);
        if (is_bf16) {
            a = round_bf16_v(a);
            b = round_bf16_v(b);
            d = round_bf16_v(d);
            e = round_bf16_v(e);
        }
        store16(out, i, _mm512_sub_ps(a, b), is_bf16, m);
        store16(out, i + h, _mm512_add_ps(d, e), is_bf16, m);
    }
#else
    for (int64_t i = 0; i < h; i++) {
        float c = cos[i], s = sin[i];
        if (is_bf16) {
            c = bf16_to_f32(f32_to_bf16(c));
            s = bf16_to_f32(f32_to_bf16(s));
        }
        const float x1 = load1(x, i, is_bf16), x2 = load1(x, i + h, is_bf16);
        float a = x1 * c, b = x2 * s, d = x2 * c, e = x1 * s;
        if (is_bf16) {
            a = bf16_to_f32(f32_to_bf16(a));
            b = bf16_to_f32(f32_to_bf16(b));
            d = bf16_to_f32(f32_to_bf16(d));
            e = bf16_to_f32(f32_to_bf16(e));
        }
        store1(out, i, a - b, is_bf16);
        store1(out, i + h, d + e, is_bf16);
    }
#endif
}

/* q [T, nq * 2h] and k [T, nk * 2h] (row strides in elements, heads contiguous) -> q_out, k_out contiguous.
 * cos_cache / sin_cache [max_position, h] float32; positions [T] int64.
 * Returns 0, or -1 (nothing written) when a position is outside [0, max_position). */
int rotary_neox(const int64_t *positions, const void *q, int64_t q_stride, int64_t nq, const void *k,
                int64_t k_stride, int64_t nk, const float *cos_cache, const float *sin_cache, int64_t h,
                int64_t max_position, void *q_out, void *k_out, int64_t num_tokens, int is_bf16, int num_threads) {
    const int64_t es = is_bf16 ? 2 : 4, d = 2 * h;
    for (int64_t t = 0; t < num_tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * (nq + nk) * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos_cache + positions[t] * h, *s = sin_cache + positions[t] * h;
        for (int64_t j = 0; j < nq; j++)
            rope_head((const char *)q + (t * q_stride + j * d) * es, (char *)q_out + (t * nq + j) * d * es, c, s, h,
                      is_bf16);
        for (int64_t j = 0; j < nk; j++)
            rope_head((const char *)k + (t * k_stride + j * d) * es, (char *)k_out + (t * nk + j) * d * es, c, s, h,
                      is_bf16);
    }
    return 0;
}

/* k, v [T, row] (row = Hkv * D elements of es bytes; row strides k_stride / v_stride in elements) -> the flat
 * caches [num_slots, row] (contiguous) at slots [T] int64; a slot of -1 is skipped.
 * Returns 0, or -1 (nothing written) when a slot is outside [-1, num_slots). One thread: a decode step's
 * rows are a few KiB, less than an OpenMP region's start-up costs. */
int write_kv_cache(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
                   const int64_t *slots, int64_t num_tokens, int64_t row, int64_t num_slots, int64_t es) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -1;
    const size_t n = (size_t)(row * es);
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)k_cache + slots[t] * row * es, (const char *)k + t * k_stride * es, n);
        memcpy((char *)v_cache + slots[t] * row * es, (const char *)v + t * v_stride * es, n);
    }
    return 0;
}
