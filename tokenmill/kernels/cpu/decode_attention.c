/* Decode attention straight from the paged KV cache, on CPU (built and called by decode.py).
 *
 * Each decode row has one query token; it attends over its keys at positions
 * [start, seq_len), read where they lie in the cache [num_blocks, block_size,
 * num_kv_heads, head_dim] through the row's block table (start > 0 only with
 * a sliding window W: start = seq_len - W, HF's mask). One work item is one
 * (row, KV head) pair; the G = H / Hkv query heads of the KV head share each
 * value load and each key's trip from memory (pass 1 re-reads a 16-key chunk
 * from L1 per query head). Per item:
 *
 *   scores:  s[g][t] = scale * (q_g . k_t)        (soft-capped: cap * tanh(s / cap))
 *   softmax: p[g][t] = exp(s[g][t] - max_t s[g]) / sum_t exp(...)   (float32)
 *   values:  o_g = sum_t p[g][t] * v_t            (float32 accumulators)
 *
 * With bfloat16 the dot products are rounded to bfloat16 before the scale and
 * the probabilities are rounded to bfloat16 before P @ V, as HF's eager
 * attention rounds q @ k^T and softmax(...).to(bf16) (the scale and soft-cap
 * are applied in float32, as in block_decode; HF rounds those too); the
 * output is rounded to the query's dtype and written into the caller's
 * attention output at the row's token index.
 *
 * Speed (AVX-512, the common case): 16 keys at a time. Each key's dot product
 * is a 16-lane partial sum (vdpbf16ps on bfloat16 pairs where the CPU has
 * AVX512-BF16, else float32 FMAs), and the 16 partial sums are reduced into
 * one vector of 16 scores by a transpose-and-add tree (45 shuffles and adds
 * instead of 16 separate horizontal sums). P @ V of a bfloat16 cache takes two
 * keys per vdpbf16ps where the CPU has AVX512-BF16 (`pv_bf16_pairs`), else one
 * float32 FMA per key and head. exp is simd.h's vector
 * polynomial; exponents below -87 give 0, as in block_decode; NaN stays NaN.
 * Without AVX-512 (F, BW and VL) the same passes run as plain loops.
 *
 * fp8 KV cache (kv_fmt 1 = e4m3fn, 2 = e5m2; q and out stay float32 / bfloat16):
 * each cache byte is decoded exactly by bit operations into float16 and widened
 * (e5m2 is float16's top byte; e4m3 becomes value / 256, `e4m3_to_f16_div256` of
 * kernels/triton/fp8_quant.py), so the caller folds k_scale * unit into `scale`
 * and v_scale * unit into `out_scale` (unit = 256 for e4m3, 1 for e5m2); keys
 * then take the float32 FMA path (bfloat16 dot products are still rounded).
 *
 * Threads: the (row, KV head) items are shared by an OpenMP loop; with GCC the
 * library links libgomp.so.1, which the dynamic loader resolves to the one
 * torch already loaded (pip's x86 torch ships that soname), so
 * torch.set_num_threads governs both.
 */
#include <stdlib.h>
#include <string.h>

#include "simd.h" /* beside this file (build.py passes -I) */

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

typedef struct {
    const void *q;
    const void *k_cache, *v_cache;
    void *out;
    const int32_t *block_table;
    const int64_t *req_idx, *q_rows, *seq_lens;
    int64_t q_row_stride, out_row_stride, bt_row_stride;
    int64_t num_heads, num_kv_heads, head_dim, block_size, window;
    float scale, cap;
    int is_bf16;
    int kv_fmt;      /* 0: the cache is in q's dtype; 1: e4m3fn bytes; 2: e5m2 bytes */
    float out_scale; /* fp8: multiplies P @ V (v_scale * unit); 1 otherwise */
} Args;

/* float16 bits -> float32 (exact; subnormals, inf and NaN included). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    union { uint32_t u; float f; } v;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        const float x = (float)m * 5.9604644775390625e-8f;
        return sign ? -x : x;
    }
    v.u = sign | (e == 31 ? 0x7F800000u : (e + 112u) << 23) | (m << 13);
    return v.f;
}

/* float16 bits of an fp8 code: e5m2 exactly, e4m3fn as value / 256 (NaN codes -> NaN). */
static inline uint16_t fp8_to_f16_bits(uint8_t b, int kv_fmt) {
    if (kv_fmt == 2) return (uint16_t)(b << 8);
    uint16_t h = (uint16_t)(((b & 0x7F) << 7) | ((b & 0x80) << 8));
    return (b & 0x7F) == 0x7F ? (uint16_t)(h | 0x7E00) : h;
}

/* Element i of a KV cache row pointer: the q dtype (kv_fmt 0) or an fp8 code, as float32. */
static inline float load_kv1(const void *p, int64_t i, int is_bf16, int kv_fmt) {
    if (kv_fmt == 0) return load1(p, i, is_bf16);
    return f16_to_f32(fp8_to_f16_bits(((const uint8_t *)p)[i], kv_fmt));
}

/* Per-thread score buffer, grown on demand (never freed: one per OpenMP thread). */
static float *scratch(int64_t n) {
    static __thread float *buf = NULL;
    static __thread int64_t size = 0;
    if (n > size) {
        float *p = (float *)realloc(buf, sizeof(float) * (size_t)n);
        if (p == NULL) return NULL;
        buf = p;
        size = n;
    }
    return buf;
}

/* ---- plain-C passes (any CPU; also the fallback for shapes the vector path does not take) ---- */

/* Key or value `pos` of KV head h (table: the row's block table) widened to float32 in row[hd]. */
static inline void cache_row(const Args *a, const void *cache, const int32_t *table, int64_t pos, int64_t h,
                             float *row) {
    const int64_t hd = a->head_dim, bs = a->block_size;
    const int64_t off = ((int64_t)table[pos / bs] * bs + pos % bs) * a->num_kv_heads * hd + h * hd;
    for (int64_t d = 0; d < hd; d++) row[d] = load_kv1(cache, off + d, a->is_bf16, a->kv_fmt);
}

static int item_generic(const Args *a, int64_t r, int64_t h) {
    const int64_t G = a->num_heads / a->num_kv_heads, hd = a->head_dim;
    const int64_t seq_len = a->seq_lens[r];
    const int64_t start = (a->window > 0 && seq_len > a->window) ? seq_len - a->window : 0;
    const int64_t n = seq_len - start;
    const int32_t *table = a->block_table + a->req_idx[r] * a->bt_row_stride;
    float *s = scratch(G * n);
    if (s == NULL) return -2;
    float q[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM], row[MAX_HEAD_DIM];
    const int64_t qoff = a->q_rows[r] * a->q_row_stride + h * G * hd;
    for (int64_t i = 0; i < G * hd; i++) q[i] = load1(a->q, qoff + i, a->is_bf16);
    for (int64_t t = 0; t < n; t++) {
        cache_row(a, a->k_cache, table, start + t, h, row);
        for (int64_t g = 0; g < G; g++) {
            float dot = 0.f;
            for (int64_t d = 0; d < hd; d++) dot += q[g * hd + d] * row[d];
            float x = (a->is_bf16 ? round_bf16(dot) : dot) * a->scale;
            if (a->cap > 0.f) x = a->cap * tanhf(x / a->cap);
            s[g * n + t] = x;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * n, m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) m = sg[t] > m ? sg[t] : m;
        for (int64_t t = 0; t < n; t++) {
            const float x = sg[t] - m;
            sg[t] = x < -87.f ? 0.f : expf(x);
            sum += sg[t];
        }
        for (int64_t t = 0; t < n; t++) sg[t] = a->is_bf16 ? round_bf16(sg[t] / sum) : sg[t] / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)(G * hd));
    for (int64_t t = 0; t < n; t++) {
        cache_row(a, a->v_cache, table, start + t, h, row);
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < hd; d++) acc[g * hd + d] += s[g * n + t] * row[d];
    }
    const int64_t ooff = a->q_rows[r] * a->out_row_stride + h * G * hd;
    for (int64_t i = 0; i < G * hd; i++) store1(a->out, ooff + i, acc[i] * a->out_scale, a->is_bf16);
    return 0;
}

#if defined(TM_AVX512)
/* ---- AVX-512 passes ---------------------------------------------------------------------- */

/* 16 elements at p (bfloat16 or float32) as float32. */
static inline __m512 load16_full(const void *p, const int is_bf16) { return load16(p, 0, is_bf16, 0xffff); }

/* 16 KV elements at p (q's dtype, or fp8 codes decoded as in fp8_to_f16_bits) as float32. */
static inline __m512 load16_kv(const void *p, const int is_bf16, const int kv_fmt) {
    if (kv_fmt == 0) return load16_full(p, is_bf16);
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h;
    if (kv_fmt == 2) {
        h = _mm256_slli_epi16(b, 8);
    } else {
        const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
        h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        const __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F));
        h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
    }
    return _mm512_cvtph_ps(h);
}

/* e^x per lane for softmax exponents; x < -87 gives 0, NaN stays NaN. See the file comment. */
static inline __m512 exp_softmax(__m512 x) {
    /* unordered -> not-less-than is true: NaN lanes are kept */
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ);
    return _mm512_maskz_mov_ps(keep, exp_v(x));
}

/* out[i] = sum of the 16 lanes of v[i], for i < 16 (transpose-and-add tree). */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per lane: the lane's partial sums of v[4i .. 4i+3] */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

#if defined(__AVX512BF16__)
/* Pass 3 for a bfloat16 cache with AVX512-BF16: acc[g * HD / 16 + j] = sum_t p[g][t] * v_t[16 j .. 16 j + 16)
 * (float32), two keys per vdpbf16ps. The probabilities are already bfloat16 values (pass 2 rounds them), so
 * each product p * v is exact in float32 as in the FMA loop; the order of the float32 additions differs
 * (pairs of keys summed before they join the accumulator), and vdpbf16ps treats denormal inputs and results as
 * zero whatever MXCSR says (probabilities below FLT_MIN add nothing; negligible next to a sum of at least 1). Keys t and t + 1 are interleaved 16 bits apart by
 * unpacklo / unpackhi, which work per 128-bit lane: for a 32-element chunk, the lo vector's slot 4 L + k holds
 * element 8 L + k and the hi vector's slot 4 L + k holds element 8 L + 4 + k (L = lane 0-3, k = 0-3); the sums
 * are put back in element order once per item. An odd last key pairs with itself at probability 0 (so an inf
 * in that V row gives NaN here where the FMA loop gives inf). */
static inline __attribute__((always_inline)) void pv_bf16_pairs(const Args *a, const int32_t *table, int64_t start,
                                                                 int64_t n, const float *s, int64_t ns, int64_t h,
                                                                 const int64_t G, const int64_t HD, __m512 *acc) {
    const int64_t bs = a->block_size, ts = a->num_kv_heads * HD, J = HD / 32;
    __m512 lo[MAX_GROUP * MAX_HEAD_DIM / 32], hi[MAX_GROUP * MAX_HEAD_DIM / 32];
    for (int64_t i = 0; i < G * J; i++) lo[i] = hi[i] = _mm512_setzero_ps();
    int64_t b = start / bs, off = start % bs; /* key t's block and offset, advanced without division */
    for (int64_t t = 0; t < n; t += 2) {
        const uint16_t *v0 = (const uint16_t *)a->v_cache + ((int64_t)table[b] * bs + off) * ts + h * HD;
        if (++off == bs) off = 0, b++;
        const uint16_t *v1 = v0;
        const int two = t + 1 < n;
        if (two) {
            v1 = (const uint16_t *)a->v_cache + ((int64_t)table[b] * bs + off) * ts + h * HD;
            if (++off == bs) off = 0, b++;
        }
        __m512i vl[MAX_HEAD_DIM / 32], vh[MAX_HEAD_DIM / 32];
        for (int64_t j = 0; j < J; j++) {
            const __m512i x0 = _mm512_loadu_si512((const void *)(v0 + 32 * j));
            const __m512i x1 = _mm512_loadu_si512((const void *)(v1 + 32 * j));
            vl[j] = _mm512_unpacklo_epi16(x0, x1);
            vh[j] = _mm512_unpackhi_epi16(x0, x1);
        }
        for (int64_t g = 0; g < G; g++) {
            uint32_t p0, p1 = 0;
            memcpy(&p0, s + g * ns + t, 4);
            if (two) memcpy(&p1, s + g * ns + t + 1, 4);
            const __m512i pp = _mm512_set1_epi32((int)((p0 >> 16) | (p1 & 0xffff0000u)));
            for (int64_t j = 0; j < J; j++) {
                lo[g * J + j] = _mm512_dpbf16_ps(lo[g * J + j], (__m512bh)vl[j], (__m512bh)pp);
                hi[g * J + j] = _mm512_dpbf16_ps(hi[g * J + j], (__m512bh)vh[j], (__m512bh)pp);
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < J; j++) {
            acc[g * 2 * J + 2 * j] = _mm512_permutex2var_ps(lo[g * J + j], first, hi[g * J + j]);
            acc[g * 2 * J + 2 * j + 1] = _mm512_permutex2var_ps(lo[g * J + j], second, hi[g * J + j]);
        }
}
#endif

/* One row, G query heads per KV head and head_dim HD fixed at compile time (loops unroll). */
static inline __attribute__((always_inline)) int item_avx512(const Args *a, int64_t r, int64_t h, const int64_t G,
                                                               const int64_t HD, const int is_bf16) {
    const int64_t C = HD / 16; /* 16-lane chunks per head vector */
    const int64_t es = is_bf16 ? 2 : 4;
    const int kv_fmt = a->kv_fmt;
    const int64_t kes = kv_fmt ? 1 : es; /* bytes per cache element */
    const int64_t bs = a->block_size, ts = a->num_kv_heads * HD;
    const int64_t seq_len = a->seq_lens[r];
    const int64_t start = (a->window > 0 && seq_len > a->window) ? seq_len - a->window : 0;
    const int64_t n = seq_len - start;
    const int32_t *table = a->block_table + a->req_idx[r] * a->bt_row_stride;
    const float scale = a->scale, cap = a->cap;
    float *s = scratch(G * (n + 16));
    if (s == NULL) return -2;
    const int64_t ns = n + 16; /* score row stride: room for a whole last chunk */
    {
        const char *qh = (const char *)a->q + (a->q_rows[r] * a->q_row_stride + h * G * HD) * es;
        /* pass 1: scores, 16 keys at a time, block by block (no division per key) */
        for (int64_t t = 0; t < n;) {
            const int64_t pos = start + t, b = pos / bs, off = pos % bs;
            int64_t c = bs - off < n - t ? bs - off : n - t;
            c = c < 16 ? c : 16;
            const char *kp = (const char *)a->k_cache + (((int64_t)table[b] * bs + off) * ts + h * HD) * kes;
            for (int64_t g = 0; g < G; g++) {
                __m512 v[16];
#if defined(__AVX512BF16__)
                if (is_bf16 && kv_fmt == 0) {
                    __m512i qv[MAX_HEAD_DIM / 32];
                    for (int64_t j = 0; j < HD / 32; j++)
                        qv[j] = _mm512_loadu_si512((const void *)(qh + (g * HD + 32 * j) * 2));
                    for (int i = 0; i < 16; i++) {
                        v[i] = _mm512_setzero_ps();
                        if (i < c)
                            for (int64_t j = 0; j < HD / 32; j++)
                                v[i] = _mm512_dpbf16_ps(v[i], (__m512bh)qv[j],
                                                        (__m512bh)_mm512_loadu_si512((const void *)(kp + (i * ts + 32 * j) * 2)));
                    }
                } else
#endif
                {
                    __m512 qv[MAX_HEAD_DIM / 16];
                    for (int64_t j = 0; j < C; j++) qv[j] = load16_full(qh + (g * HD + 16 * j) * es, is_bf16);
                    for (int i = 0; i < 16; i++) {
                        v[i] = _mm512_setzero_ps();
                        if (i < c)
                            for (int64_t j = 0; j < C; j++)
                                v[i] = _mm512_fmadd_ps(qv[j], load16_kv(kp + (i * ts + 16 * j) * kes, is_bf16, kv_fmt),
                                                       v[i]);
                    }
                }
                __m512 x = hsum16(v);
                if (is_bf16) x = round_bf16_v(x);
                x = _mm512_mul_ps(x, _mm512_set1_ps(scale));
                _mm512_storeu_ps(s + g * ns + t, x);
            }
            t += c;
        }
        /* pass 2: softmax per query head */
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + g * ns;
            if (cap > 0.f)
                for (int64_t t = 0; t < n; t++) sg[t] = cap * tanhf(sg[t] / cap);
            __m512 mv = _mm512_set1_ps(-INFINITY);
            int64_t t = 0;
            for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
            const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1u);
            mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, sg + t));
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
            __m512 sum = _mm512_setzero_ps();
            for (t = 0; t < n; t += 16) { /* the tail's lanes past n are computed, not summed */
                const __mmask16 mk = (__mmask16)(n - t >= 16 ? 0xffff : (1u << (n - t)) - 1u);
                const __m512 e = exp_softmax(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));
                sum = _mm512_mask_add_ps(sum, mk, sum, e);
                _mm512_storeu_ps(sg + t, e);
            }
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
            for (t = 0; t < n; t += 16) {
                __m512 p = _mm512_mul_ps(_mm512_loadu_ps(sg + t), inv);
                _mm512_storeu_ps(sg + t, is_bf16 ? round_bf16_v(p) : p);
            }
        }
        /* pass 3: P @ V in float32 registers */
        __m512 acc[MAX_GROUP * MAX_HEAD_DIM / 16];
        for (int64_t i = 0; i < G * C; i++) acc[i] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
        if (is_bf16 && kv_fmt == 0) {
            pv_bf16_pairs(a, table, start, n, s, ns, h, G, HD, acc);
            goto store;
        }
#endif
        for (int64_t t = 0; t < n;) {
            const int64_t pos = start + t, b = pos / bs, off = pos % bs;
            const int64_t c = bs - off < n - t ? bs - off : n - t;
            const char *vp = (const char *)a->v_cache + (((int64_t)table[b] * bs + off) * ts + h * HD) * kes;
            for (int64_t i = 0; i < c; i++, t++) {
                __m512 vv[MAX_HEAD_DIM / 16];
                for (int64_t j = 0; j < C; j++) vv[j] = load16_kv(vp + (i * ts + 16 * j) * kes, is_bf16, kv_fmt);
                for (int64_t g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(s[g * ns + t]);
                    for (int64_t j = 0; j < C; j++) acc[g * C + j] = _mm512_fmadd_ps(p, vv[j], acc[g * C + j]);
                }
            }
        }
#if defined(__AVX512BF16__)
    store:;
#endif
        char *op = (char *)a->out + (a->q_rows[r] * a->out_row_stride + h * G * HD) * es;
        const __m512 osc = _mm512_set1_ps(a->out_scale);
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < C; j++)
                store16(op, g * HD + 16 * j, kv_fmt ? _mm512_mul_ps(acc[g * C + j], osc) : acc[g * C + j], is_bf16,
                        0xffff);
    }
    return 0;
}

/* The specialized cases: head_dim 64 / 128, group 1-8, both dtypes. */
#define CASE_G(G, HD)                                                                    \
    case G:                                                                              \
        return a->is_bf16 ? item_avx512(a, r, h, G, HD, 1) : item_avx512(a, r, h, G, HD, 0);

#define SWITCH_G(HD)  \
    switch (G) {      \
        CASE_G(1, HD) \
        CASE_G(2, HD) \
        CASE_G(3, HD) \
        CASE_G(4, HD) \
        CASE_G(5, HD) \
        CASE_G(6, HD) \
        CASE_G(7, HD) \
        CASE_G(8, HD) \
        default: break; \
    }
#endif /* TM_AVX512 */

static int item(const Args *a, int64_t r, int64_t h) {
#if defined(TM_AVX512)
    const int64_t G = a->num_heads / a->num_kv_heads;
    if (a->head_dim == 64) { SWITCH_G(64) }
    else if (a->head_dim == 128) { SWITCH_G(128) }
#endif
    return item_generic(a, r, h);
}

/* Entry point. q [T, H, D] (row stride q_row_stride elements, heads contiguous), caches [num_blocks, bs,
 * Hkv, D] contiguous, out [T, H, D] like q (row stride out_row_stride), block_table [num_reqs, *] int32
 * (row stride bt_row_stride), req_idx / q_rows / seq_lens [num_rows] int64. q and out are both
 * bfloat16 (is_bf16 = 1) or both float32; the caches are in that dtype (kv_fmt 0) or hold fp8 codes
 * (kv_fmt 1 e4m3fn, 2 e5m2; see the file comment for scale and out_scale). Writes out[q_rows[i]] for
 * every row i.
 * Returns 0; -1 when G > MAX_GROUP or head_dim > MAX_HEAD_DIM; -2 when the score buffer could not be
 * allocated. */
int paged_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           void *out, int64_t out_row_stride, const int32_t *block_table, int64_t bt_row_stride,
                           const int64_t *req_idx, const int64_t *q_rows, const int64_t *seq_lens,
                           int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t window, float scale, float cap, int is_bf16, int kv_fmt,
                           float out_scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim > MAX_HEAD_DIM)
        return -1;
    const Args a = {q, k_cache, v_cache, out, block_table, req_idx, q_rows, seq_lens, q_row_stride,
                    out_row_stride, bt_row_stride, num_heads, num_kv_heads, head_dim, block_size, window,
                    scale, cap, is_bf16, kv_fmt, out_scale};
    int rc = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(min : rc)
    for (int64_t i = 0; i < num_rows * num_kv_heads; i++) {
        const int e = item(&a, i / num_kv_heads, i % num_kv_heads);
        rc = e < rc ? e : rc;
    }
    return rc;
}
