/* Helpers shared by tokenmill's CPU kernels (elementwise.c, decode_attention.c).
 *
 * bfloat16 <-> float32 (round to nearest even, NaN made quiet), element loads
 * and stores of either dtype, and with AVX-512 (F, BW and VL; TM_AVX512) their
 * 16-lane forms and a vector e^x: x = n ln2 + r (Cody-Waite, ln2 in two
 * parts), e^r by its degree-7 Taylor polynomial (relative error < 1e-8 for
 * |r| <= ln2 / 2), times 2^n; it saturates to inf above 88.7 and to 0 below
 * -104, and NaN passes through. build.py hashes this header with each
 * source, so editing it rebuilds both libraries.
 */
#ifndef TOKENMILL_CPU_SIMD_H
#define TOKENMILL_CPU_SIMD_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TM_AVX512 1
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

/* bfloat16 bits of x, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float x) {
    union { uint32_t u; float f; } v;
    v.f = x;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* Element i of p (bfloat16 or float32) as float32. */
static inline float load1(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Store x at p[i]; returns the stored value as float (rounded for bfloat16). */
static inline float store1(void *p, int64_t i, float x, int is_bf16) {
    if (is_bf16) {
        const uint16_t b = f32_to_bf16(x);
        ((uint16_t *)p)[i] = b;
        return bf16_to_f32(b);
    }
    ((float *)p)[i] = x;
    return x;
}

#if defined(TM_AVX512)
static inline __mmask16 tail_mask(int64_t left) {
    return (__mmask16)(left >= 16 ? 0xffff : ((1u << left) - 1u));
}

/* Lanes m of p[i .. i + 16) (bfloat16 or float32) as float32; the others 0. */
static inline __m512 load16(const void *p, int64_t i, int is_bf16, __mmask16 m) {
    if (is_bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* Each lane rounded to bfloat16 precision (nearest even). */
static inline __m512 round_bf16_v(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    /* NaN: its top half, made quiet (as f32_to_bf16) */
    const __m512 quiet = _mm512_castsi512_ps(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet);
}

/* Store the lanes of m at p[i] (bfloat16: rounded); returns the stored values as float32. */
static inline __m512 store16(void *p, int64_t i, __m512 x, int is_bf16, __mmask16 m) {
    if (is_bf16) {
        x = round_bf16_v(x);
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
        return x;
    }
    _mm512_mask_storeu_ps((float *)p + i, m, x);
    return x;
}

/* e^x per lane (see the header comment). */
static inline __m512 exp_v(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x)); /* NaN passes through */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif /* TOKENMILL_CPU_SIMD_H */
