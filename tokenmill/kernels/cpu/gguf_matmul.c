/* Matmul with GGUF-quantized weights kept as ggml blocks (called by gguf_matmul.py).
 *
 * out[t, r] = sum_k W[r, k] * x[t, k], where row r of W is stored as ggml's
 * quantized blocks and dequantized 32 weights at a time inside the dot product
 * (never written to memory). Block layouts (ggml-common.h: block_q4_0, block_q4_1,
 * block_q5_0, block_q5_1, block_q8_0, block_q4_K, block_q6_K; d, dmin, m are float16):
 *
 *   Q4_0 (32 weights, 18 bytes): | d | qs[16] |           w[j] = d * (nib(j) - 8)
 *   Q4_1 (32 weights, 20 bytes): | d | m | qs[16] |       w[j] = d * nib(j) + m
 *      nib(j) = qs[j] & 15 for j < 16, qs[j - 16] >> 4 for j >= 16
 *   Q5_0 (32 weights, 22 bytes): | d | qh[4] | qs[16] |   w[j] = d * (nib(j) + 16 hb(j) - 16)
 *   Q5_1 (32 weights, 24 bytes): | d | m | qh[4] | qs[16] |  w[j] = d * (nib(j) + 16 hb(j)) + m
 *      hb(j) = bit j of qh read as a little-endian uint32
 *   Q8_0 (32 weights, 34 bytes): | d | qs[32] int8 |      w[j] = d * qs[j]
 *   Q4_K (256 weights, 144 bytes): | d | dmin | scales[12] | qs[128] |
 *      8 sub-blocks of 32 with 6-bit scale sc[i] and min mn[i] packed in scales[12]
 *      (i < 4: sc = s[i] & 63, mn = s[i + 4] & 63; else sc = (s[i + 4] & 15) | (s[i - 4] >> 6) << 4,
 *      mn = (s[i + 4] >> 4) | (s[i] >> 6) << 4); sub-block i = 2g + h reads qs[32g .. 32g + 32),
 *      low nibbles for h = 0, high for h = 1:   w = (d * sc[i]) * q - dmin * mn[i]
 *   Q6_K (256 weights, 210 bytes): | ql[128] | qh[64] | scales[16] int8 | d |
 *      chunk i of 32 (n = i / 4, k = i % 4): q[l] = ((ql[64n + 32(k % 2) + l] >> 4(k / 2)) & 15)
 *      | ((qh[32n + l] >> 2k) & 3) << 4, minus 32; weight j of the superblock uses scale j / 16:
 *      w = (d * scales[j / 16]) * q
 *
 * The arithmetic and its roundings follow the `gguf` package's reference
 * (gguf/quants.py, itself ggml's dequantize_row_*), so the dequantized weights
 * (gguf_dequantize) are its bits; the dot products differ from a float32
 * matmul of those weights only by the summation order and, on AVX-512, by
 * factoring each chunk's scale and offset out of its 32 products
 * (d * (q . x) + m * sum(x); see row_dot). Activations x are
 * float32 or bfloat16 (bfloat16 is widened once per call), the sums float32.
 *
 * Speed: with AVX-512 each 32-weight chunk becomes two 16-lane float vectors
 * (byte -> int32 widening, nibble mask / shift, convert, scale) that are FMA'd
 * against up to TOKENS_PER_PASS token rows at once, so a chunk is decoded once
 * per pass, not once per token. One token (decode at concurrency 1) of
 * Q4_1, Q5_0 and Q5_1 takes row_dot1_small, which
 * converts 16 chunks' float16 scales (and offsets) with one gather each and
 * adds the offsets' term m * sum(x) as one 16-lane FMA per 16 chunks: on the
 * Intel Xeon (AVX-512, 2 cores) of session 14 the per-chunk scalar
 * conversions, register broadcasts and the offset sum were most of the loop,
 * and SmolLM2's 66 MB of Q4_1 went from 3.6 to 6.8 GB/s on one thread
 * (benchmarks/gguf_matmul_bench.py). Q8_0 (already ~17 GB/s) and Q4_0
 * (0.94-0.98x there) keep row_dot. Without AVX-512 the same chunks are decoded
 * into a float[32] by plain loops (which the compiler vectorizes as it can).
 * Rows are shared by OpenMP threads (torch's libgomp, see build.py).
 */
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define PARALLEL_MIN 65536

/* 1: one-token rows of Q4_1, Q5_0 and Q5_1 take row_dot1_small (gathered scales); 0: the general
 * row_dot. A global for A/B timing in one process (benchmarks/gguf_matmul_bench.py). decoder_step.c includes
 * this file, so its library has its own copy: setting gguf_matmul's does not change the fused decode step.
 * Q4_1 / Q5_1 rows: row_dot1_small sums the offsets' term in another order than row_dot, so a token's output
 * can differ in the last bits between a one-token call and the same token inside a 4-token pass (Q5_0 gives
 * the same bits either way). */
int gguf_gather_scales = 1;
#define TOKENS_PER_PASS 4
#define ROW_TILE 16

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml_type ids */

/* IEEE half -> float (subnormals, inf and NaN included); F16C's one instruction where the CPU has it. */
static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        v.f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24 */
        v.u |= sign;
        return v.f;
    }
    v.u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
    return v.f;
#endif
}

/* Weights per block and bytes per block of a type; 0 for a type this file does not take. */
static int block_weights(int type) {
    return (type == Q4_K || type == Q6_K) ? 256 : (type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0) ? 32 : 0;
}
static int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Q4_K sub-block i's 6-bit scale and min from the 12 packed bytes s. */
static inline void q4k_scale_min(const uint8_t *s, int i, int *sc, int *mn) {
    if (i < 4) {
        *sc = s[i] & 63;
        *mn = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 15) | ((s[i - 4] >> 6) << 4);
        *mn = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
    }
}

/* Chunk c (weights 32c .. 32c + 32) of a row as float32, plain C. */
static inline void chunk_scalar(int type, const uint8_t *row, int64_t c, float *w) {
    switch (type) {
    case Q4_0: {
        const uint8_t *b = row + c * 18;
        const float d = h2f(b);
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)((b[2 + j] & 15) - 8);
            w[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        break;
    }
    case Q4_1: {
        const uint8_t *b = row + c * 20;
        const float d = h2f(b), m = h2f(b + 2);
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)(b[4 + j] & 15) + m;
            w[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        break;
    }
    case Q5_0:
    case Q5_1: {
        const int one = type == Q5_1, bytes = one ? 24 : 22;
        const uint8_t *b = row + c * bytes;
        const float d = h2f(b), m = one ? h2f(b + 2) : 0.f;
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * one, 4);
        const uint8_t *qs = b + 6 + 2 * one;
        for (int j = 0; j < 32; j++) {
            const int q = (j < 16 ? qs[j] & 15 : qs[j - 16] >> 4) | (int)(((qh >> j) & 1u) << 4);
            w[j] = one ? d * (float)q + m : d * (float)(q - 16);
        }
        break;
    }
    case Q8_0: {
        const uint8_t *b = row + c * 34;
        const float d = h2f(b);
        for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)b[2 + j];
        break;
    }
    case Q4_K: {
        const uint8_t *b = row + (c / 8) * 144;
        const int i = (int)(c % 8), sh = 4 * (i % 2);
        int sc, mn;
        q4k_scale_min(b + 4, i, &sc, &mn);
        const float dsc = h2f(b) * (float)sc, dm = h2f(b + 2) * (float)mn;
        const uint8_t *qs = b + 16 + 32 * (i / 2);
        for (int j = 0; j < 32; j++) w[j] = dsc * (float)((qs[j] >> sh) & 15) - dm;
        break;
    }
    case Q6_K: {
        const uint8_t *b = row + (c / 8) * 210;
        const int i = (int)(c % 8), n = i / 4, k = i % 4;
        const uint8_t *ql = b + 64 * n + 32 * (k % 2), *qh = b + 128 + 32 * n;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = h2f(b + 208);
        const float d0 = d * (float)scales[2 * i], d1 = d * (float)scales[2 * i + 1];
        for (int j = 0; j < 32; j++) {
            const int q = (((ql[j] >> (4 * (k / 2))) & 15) | (((qh[j] >> (2 * k)) & 3) << 4)) - 32;
            w[j] = (j < 16 ? d0 : d1) * (float)q;
        }
        break;
    }
    }
}

#if defined(TM_AVX512)
static inline __m512 cvt16(__m128i bytes, int is_signed) {
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}

/* Types whose 32-weight chunk is one scale and one offset: w[j] = d * q[j] + m with integer-valued q[j]
 * (Q4_0: q = nib - 8, m = 0; Q4_1: q = nib, m; Q5_0: q = nib + 16 hb - 16, m = 0; Q5_1: q = nib + 16 hb, m;
 * Q8_0: q = qs, m = 0; Q4_K: q = nibble, d = d * sc, m = -dmin * mn). Q6_K has two scales per chunk. */
#define FACTORED(type) ((type) != Q6_K)
#define HAS_OFFSET(type) ((type) == Q4_1 || (type) == Q5_1 || (type) == Q4_K)

/* Chunk c of a row as its integer values q (exact in float32: |q| <= 128) in two 16-lane vectors, its scale
 * *d and offset *m (FACTORED types only). */
static inline void chunk_qvec(int type, const uint8_t *row, int64_t c, __m512 *q0, __m512 *q1, float *d, float *m) {
    const __m512i low4 = _mm512_set1_epi32(15);
    *m = 0.f;
    switch (type) {
    case Q4_0: {
        const uint8_t *b = row + c * 18;
        *d = h2f(b);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))), eight = _mm512_set1_epi32(8);
        *q0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, low4), eight));
        *q1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight));
        break;
    }
    case Q4_1: {
        const uint8_t *b = row + c * 20;
        *d = h2f(b);
        *m = h2f(b + 2);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4)));
        *q0 = _mm512_cvtepi32_ps(_mm512_and_si512(q, low4));
        *q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
        break;
    }
    case Q5_0:
    case Q5_1: {
        const int one = type == Q5_1;
        const uint8_t *b = row + c * (one ? 24 : 22);
        *d = h2f(b);
        if (one) *m = h2f(b + 2);
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * one, 4);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 6 + 2 * one)));
        const __m512i sixteen = _mm512_set1_epi32(16), off = _mm512_set1_epi32(one ? 0 : 16);
        const __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_srli_epi32(q, 4);
        *q0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_mask_add_epi32(lo, (__mmask16)(qh & 0xffffu), lo, sixteen), off));
        *q1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_mask_add_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen), off));
        break;
    }
    case Q8_0: {
        const uint8_t *b = row + c * 34;
        *d = h2f(b);
        *q0 = cvt16(_mm_loadu_si128((const __m128i *)(b + 2)), 1);
        *q1 = cvt16(_mm_loadu_si128((const __m128i *)(b + 18)), 1);
        break;
    }
    case Q4_K: {
        const uint8_t *b = row + (c / 8) * 144;
        const int i = (int)(c % 8);
        int sc, mn;
        q4k_scale_min(b + 4, i, &sc, &mn);
        *d = h2f(b) * (float)sc;
        *m = -(h2f(b + 2) * (float)mn);
        const uint8_t *qs = b + 16 + 32 * (i / 2);
        const __m128i sh = _mm_cvtsi32_si128(4 * (i % 2));
        *q0 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs)), sh), low4));
        *q1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))), sh), low4));
        break;
    }
    default:
        *q0 = *q1 = _mm512_setzero_ps();
        *d = 0.f;
        break;
    }
}

/* Chunk c of a row as two 16-lane vectors (weights 0-15 in *w0, 16-31 in *w1); same roundings as chunk_scalar:
 * d * q (+ m) from `chunk_qvec` for the one-scale types, Q6_K's two scales here. */
static inline void chunk_vec(int type, const uint8_t *row, int64_t c, __m512 *w0, __m512 *w1) {
    if (FACTORED(type)) {
        __m512 q0, q1;
        float d, m;
        chunk_qvec(type, row, c, &q0, &q1, &d, &m);
        const __m512 vd = _mm512_set1_ps(d);
        *w0 = _mm512_mul_ps(vd, q0);
        *w1 = _mm512_mul_ps(vd, q1);
        if (HAS_OFFSET(type)) {
            const __m512 vm = _mm512_set1_ps(m);
            *w0 = _mm512_add_ps(*w0, vm);
            *w1 = _mm512_add_ps(*w1, vm);
        }
        return;
    }
    const uint8_t *b = row + (c / 8) * 210; /* Q6_K */
    const int i = (int)(c % 8), n = i / 4, k = i % 4;
    const uint8_t *ql = b + 64 * n + 32 * (k % 2), *qh = b + 128 + 32 * n;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    const __m128i shl = _mm_cvtsi32_si128(4 * (k / 2)), shh = _mm_cvtsi32_si128(2 * k);
    const __m512i low4 = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
    __m512 w[2];
    for (int half = 0; half < 2; half++) {
        const __m512i lo = _mm512_and_si512(
            _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16 * half))), shl), low4);
        const __m512i hi = _mm512_and_si512(
            _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * half))), shh), three);
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), off);
        w[half] = _mm512_mul_ps(_mm512_set1_ps(d * (float)scales[2 * i + half]), _mm512_cvtepi32_ps(q));
    }
    *w0 = w[0];
    *w1 = w[1];
}
#endif

#if defined(TM_AVX512)
/* Bytes per 32-weight block of the one-scale 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); 0 for others. */
#define SMALL_BLOCK_BYTES(type) \
    ((type) == Q4_0 ? 18 : (type) == Q4_1 ? 20 : (type) == Q5_0 ? 22 : (type) == Q5_1 ? 24 : (type) == Q8_0 ? 34 : 0)

/* The float16 at byte `off` of the blocks c0 .. c0 + 15 of a row of `bb`-byte blocks, as float32 (one gather of
 * 32-bit words and one conversion instead of 16 scalar ones); lanes c0 + i >= chunks give 0. The 4-byte read at
 * `off` stays inside its block (off + 4 <= bb). */
static inline __m512 gather_f16(const uint8_t *row, int64_t c0, int64_t chunks, int bb, int off) {
    const __mmask16 live = tail_mask(chunks - c0);
    const __m512i idx = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)c0),
                                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                              13, 14, 15)),
                                           _mm512_set1_epi32(bb));
    const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, row + off, 1);
    return _mm512_maskz_mov_ps(live, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)));
}

/* One token (M = 1) of a row of a one-scale 32-weight type: d_c * (q_c . x_c) per chunk as in row_dot, but the
 * chunks' scales come 16 at a time from `gather_f16` (a scalar conversion and a register broadcast per chunk was
 * most of the loop's work), and the offsets' term sum_c m_c * xsum_c is one 16-lane FMA per 16 chunks. Same
 * products as row_dot's; the float32 sums are added in another order. Returns the row's dot product. */
static inline __attribute__((always_inline)) float row_dot1_small(const int type, const uint8_t *row, int64_t k,
                                                                   const float *x, const float *xsum) {
    const int64_t chunks = k / 32;
    const int bb = SMALL_BLOCK_BYTES(type);
    __m512 accA = _mm512_setzero_ps(), accB = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    float dbuf[16];
    for (int64_t c0 = 0; c0 < chunks; c0 += 16) {
        _mm512_storeu_ps(dbuf, gather_f16(row, c0, chunks, bb, 0));
        if (HAS_OFFSET(type))
            macc = _mm512_fmadd_ps(gather_f16(row, c0, chunks, bb, 2),
                                   _mm512_maskz_loadu_ps(tail_mask(chunks - c0), xsum + c0), macc);
        const int64_t n = chunks - c0 < 16 ? chunks - c0 : 16;
        int64_t i = 0;
        for (; i + 1 < n; i += 2) { /* two chains (even and odd chunks) hide the FMA latency */
            __m512 q0, q1, p0, p1;
            float d, m;
            chunk_qvec(type, row, c0 + i, &q0, &q1, &d, &m); /* d, m unused here: the compiler drops them */
            chunk_qvec(type, row, c0 + i + 1, &p0, &p1, &d, &m);
            const float *xc = x + 32 * (c0 + i);
            accA = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i]),
                                   _mm512_fmadd_ps(q1, _mm512_loadu_ps(xc + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xc))),
                                   accA);
            accB = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i + 1]),
                                   _mm512_fmadd_ps(p1, _mm512_loadu_ps(xc + 48), _mm512_mul_ps(p0, _mm512_loadu_ps(xc + 32))),
                                   accB);
        }
        if (i < n) {
            __m512 q0, q1;
            float d, m;
            chunk_qvec(type, row, c0 + i, &q0, &q1, &d, &m);
            const float *xc = x + 32 * (c0 + i);
            accA = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i]),
                                   _mm512_fmadd_ps(q1, _mm512_loadu_ps(xc + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xc))),
                                   accA);
        }
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(accA, accB));
    if (HAS_OFFSET(type)) s += _mm512_reduce_add_ps(macc);
    return s;
}
#endif

/* out[t * out_stride + r] for row r and tokens [t0, t0 + NT), x float32 [T, k] (dense). Always inlined with
 * constant type and NT, so the type switch folds away and the accumulators live in registers. */
static inline __attribute__((always_inline)) void row_dot(const int type, const int NT, const uint8_t *row,
                                                          int64_t r, int64_t k, const float *x, const float *xsum,
                                                          int64_t t0, void *out, int64_t out_stride, int is_bf16) {
    const int64_t chunks = k / 32;
#if defined(TM_AVX512)
    if (NT == 1 && (type == Q4_1 || type == Q5_0 || type == Q5_1) && gguf_gather_scales) {
        store1(out, t0 * out_stride + r, row_dot1_small(type, row, k, x + t0 * k, xsum ? xsum + t0 * chunks : NULL),
               is_bf16);
        return;
    }
    if (FACTORED(type)) {
        /* d * (q . x) + m * sum(x) per chunk: the scale and offset leave the 32-lane work (xsum[t * chunks + c]
         * = sum of x's chunk c). Two chains per token (even and odd chunks) hide the FMA latency. */
        __m512 accA[TOKENS_PER_PASS], accB[TOKENS_PER_PASS];
        float msum[TOKENS_PER_PASS];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            accA[t] = accB[t] = _mm512_setzero_ps();
            msum[t] = 0.f;
        }
        for (int64_t c = 0; c < chunks; c += 2) {
            const int pair = c + 1 < chunks;
            __m512 q0, q1, p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
            float d, m, e = 0.f, n = 0.f;
            chunk_qvec(type, row, c, &q0, &q1, &d, &m);
            if (pair) chunk_qvec(type, row, c + 1, &p0, &p1, &e, &n);
            const __m512 dv = _mm512_set1_ps(d), ev = _mm512_set1_ps(e);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const float *xt = x + (t0 + t) * k + 32 * c;
                accA[t] = _mm512_fmadd_ps(
                    dv, _mm512_fmadd_ps(q1, _mm512_loadu_ps(xt + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xt))), accA[t]);
                if (HAS_OFFSET(type)) msum[t] += m * xsum[(t0 + t) * chunks + c];
                if (pair) {
                    accB[t] = _mm512_fmadd_ps(
                        ev, _mm512_fmadd_ps(p1, _mm512_loadu_ps(xt + 48), _mm512_mul_ps(p0, _mm512_loadu_ps(xt + 32))),
                        accB[t]);
                    if (HAS_OFFSET(type)) msum[t] += n * xsum[(t0 + t) * chunks + c + 1];
                }
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            store1(out, (t0 + t) * out_stride + r, _mm512_reduce_add_ps(_mm512_add_ps(accA[t], accB[t])) + msum[t],
                   is_bf16);
        return;
    }
    /* two accumulators per token (weights 0-15 and 16-31 of a chunk): two independent FMA chains */
    __m512 acc0[TOKENS_PER_PASS], acc1[TOKENS_PER_PASS];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __m512 w0, w1;
        chunk_vec(type, row, c, &w0, &w1);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const float *xt = x + (t0 + t) * k + 32 * c;
            acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), acc0[t]);
            acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), acc1[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++)
        store1(out, (t0 + t) * out_stride + r, _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t])), is_bf16);
#else
    float acc[TOKENS_PER_PASS][32];
    memset(acc, 0, sizeof(acc));
    float wc[32];
    for (int64_t c = 0; c < chunks; c++) {
        chunk_scalar(type, row, c, wc);
        for (int t = 0; t < NT; t++) {
            const float *xt = x + (t0 + t) * k + 32 * c;
            for (int j = 0; j < 32; j++) acc[t][j] += wc[j] * xt[j];
        }
    }
    for (int t = 0; t < NT; t++) {
        float s = 0.f;
        for (int j = 0; j < 32; j++) s += acc[t][j];
        store1(out, (t0 + t) * out_stride + r, s, is_bf16);
    }
#endif
}

/* Rows [r0, r1) of one type, every token. */
static inline __attribute__((always_inline)) void rows_of_type(const int type, const uint8_t *w, int64_t row_bytes,
                                                               int64_t r0, int64_t r1, int64_t k, const float *x,
                                                               const float *xsum, int64_t n_tokens, void *out,
                                                               int64_t out_stride, int is_bf16) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        int64_t t0 = 0;
        for (; t0 + TOKENS_PER_PASS <= n_tokens; t0 += TOKENS_PER_PASS)
            row_dot(type, TOKENS_PER_PASS, row, r, k, x, xsum, t0, out, out_stride, is_bf16);
        switch (n_tokens - t0) {
        case 1: row_dot(type, 1, row, r, k, x, xsum, t0, out, out_stride, is_bf16); break;
        case 2: row_dot(type, 2, row, r, k, x, xsum, t0, out, out_stride, is_bf16); break;
        case 3: row_dot(type, 3, row, r, k, x, xsum, t0, out, out_stride, is_bf16); break;
        default: break;
        }
    }
}

static void rows_dispatch(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
                          const float *x, const float *xsum, int64_t n_tokens, void *out, int64_t out_stride,
                          int is_bf16) {
    switch (type) {
    case Q4_0: rows_of_type(Q4_0, w, row_bytes, r0, r1, k, x, xsum, n_tokens, out, out_stride, is_bf16); break;
    case Q4_1: rows_of_type(Q4_1, w, row_bytes, r0, r1, k, x, xsum, n_tokens, out, out_stride, is_bf16); break;
    case Q5_0: rows_of_type(Q5_0, w, row_bytes, r0, r1, k, x, xsum, n_tokens, out, out_stride, is_bf16); break;
    case Q5_1: rows_of_type(Q5_1, w, row_bytes, r0, r1, k, x, xsum, n_tokens, out, out_stride, is_bf16); break;
    case Q8_0: rows_of_type(Q8_0, w, row_bytes, r0, r1, k, x, xsum, n_tokens, out, out_stride, is_bf16); break;
    case Q4_K: rows_of_type(Q4_K, w, row_bytes, r0, r1, k, x, xsum, n_tokens, out, out_stride, is_bf16); break;
    case Q6_K: rows_of_type(Q6_K, w, row_bytes, r0, r1, k, x, xsum, n_tokens, out, out_stride, is_bf16); break;
    default: break;
    }
}

/* w: rows [n_rows] of row_bytes each (k / block_weights blocks of `type`); x [T, k] (row stride x_stride elements,
 * float32 or bfloat16); out [T, n_rows] (row stride out_stride, x's dtype). Returns 0, -1 for a type or k the
 * kernel does not take, -2 when the float32 copy of a bfloat16 x could not be allocated. */
int gguf_matmul(const uint8_t *w, int64_t row_bytes, int type, int64_t n_rows, int64_t k, const void *x,
                int64_t x_stride, int64_t n_tokens, void *out, int64_t out_stride, int is_bf16, int num_threads) {
    const int bw = block_weights(type);
    if (bw == 0 || k % bw != 0 || row_bytes != k / bw * block_bytes(type)) return -1;
    const float *xf = (const float *)x;
    float *tmp = NULL;
    if (is_bf16 || x_stride != k) { /* one dense float32 copy: the inner loop reads x at stride k */
        tmp = (float *)malloc(sizeof(float) * (size_t)(n_tokens * k));
        if (tmp == NULL) return -2;
        for (int64_t t = 0; t < n_tokens; t++)
            for (int64_t j = 0; j < k; j++) tmp[t * k + j] = load1(x, t * x_stride + j, is_bf16);
        xf = tmp;
    }
    float *xsum = NULL; /* [T, k / 32]: each 32-element chunk's sum of x, for the offset term of FACTORED types */
#if defined(TM_AVX512)
    if (HAS_OFFSET(type)) {
        const int64_t chunks = k / 32;
        xsum = (float *)malloc(sizeof(float) * (size_t)(n_tokens * chunks));
        if (xsum == NULL) {
            free(tmp);
            return -2;
        }
        for (int64_t t = 0; t < n_tokens; t++)
            for (int64_t c = 0; c < chunks; c++) {
                const float *xc = xf + t * k + 32 * c;
                xsum[t * chunks + c] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xc), _mm512_loadu_ps(xc + 16)));
            }
    }
#endif
    /* ROW_TILE rows per work item: the same rows of W meet every token while they are in L1/L2 */
    const int64_t tiles = (n_rows + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n_rows * k * n_tokens >= PARALLEL_MIN)
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t r0 = i * ROW_TILE, r1 = r0 + ROW_TILE < n_rows ? r0 + ROW_TILE : n_rows;
        rows_dispatch(type, w, row_bytes, r0, r1, k, xf, xsum, n_tokens, out, out_stride, is_bf16);
    }
    free(tmp);
    free(xsum);
    return 0;
}

/* Dequantize rows [n_rows] of w (as gguf_matmul) into out [n_rows, k] float32 (row stride out_stride).
 * Returns 0, or -1 for a type or k the kernel does not take. */
int gguf_dequantize(const uint8_t *w, int64_t row_bytes, int type, int64_t n_rows, int64_t k, float *out,
                    int64_t out_stride, int num_threads) {
    const int bw = block_weights(type);
    if (bw == 0 || k % bw != 0 || row_bytes != k / bw * block_bytes(type)) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n_rows * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = w + r * row_bytes;
        float *o = out + r * out_stride;
        for (int64_t c = 0; c < k / 32; c++) {
#if defined(TM_AVX512)
            __m512 w0, w1;
            chunk_vec(type, row, c, &w0, &w1);
            _mm512_storeu_ps(o + 32 * c, w0);
            _mm512_storeu_ps(o + 32 * c + 16, w1);
#else
            chunk_scalar(type, row, c, o + 32 * c);
#endif
        }
    }
    return 0;
}
