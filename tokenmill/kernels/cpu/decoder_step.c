/* One decode token through a whole Llama-style decoder stack on CPU, in one call (called by decoder_step.py).
 *
 * A concurrency-1 decode step of a small model runs ~360 PyTorch module calls and ~330 tensor
 * allocations around ~150 C kernel calls; this file runs the same kernels back to back from C:
 * it includes the other kernel sources (one translation unit, no copies) and calls their entry
 * points in the order the PyTorch modules would, on one token, float32, with the linear weights
 * kept as GGUF blocks. Per layer (models/decoder_layers.py's DecoderLayer, DecoderAttention,
 * GatedMLP; pre-norm, no biases, no q/k norm, neox RoPE over the whole head, SiLU gate):
 *
 *   layer 0:  res = x;            xn = RMSNorm_in(x)
 *   else:     res = x + res;      xn = RMSNorm_in(res)         (rms_norm with the residual)
 *   qkv = xn @ Wqkv^T                                           (gguf_matmul, per segment)
 *   q, k = RoPE(q, k at `position`); k -> k_cache[slot], v -> v_cache[slot]
 *   a = decode attention of q over the row's `seq_len` cached keys (paged_decode_attention)
 *   x = a @ Wo^T;  res = x + res;  xn = RMSNorm_post(res)
 *   x = (silu(g) * u) @ Wdown^T,  [g | u] = xn @ Wgate_up^T    (silu_and_mul)
 *
 * and after the last layer out = RMSNorm_final(x + res). Each step is the kernel the module
 * path calls with the same arguments, so the result is that path's bits (float32; threads share
 * rows inside each kernel, never a sum).
 */
#include <string.h>

#include "elementwise.c"
#undef PARALLEL_MIN
#include "gguf_matmul.c"
#undef PARALLEL_MIN
#include "decode_attention.c"

/* Layout of one layer's int64 words (decoder_step.py's LAYER_WORDS, built once per model):
 *   [0] input norm weight*  [1] post-attention norm weight*  [2] k cache*  [3] v cache*  [4] window (0: none)
 *   [5 + LIN_WORDS * j], j = 0 qkv, 1 o, 2 gate_up, 3 down: a linear as its segment count n, then MAX_SEGS
 *   segments of (blocks*, row bytes, ggml type, rows, first output row). Pointers are stored as int64. */
#define MAX_SEGS 4
#define SEG_WORDS 5
#define LIN_WORDS (1 + MAX_SEGS * SEG_WORDS)
#define LAYER_HEAD 5
#define LAYER_WORDS (LAYER_HEAD + 4 * LIN_WORDS)

/* out[:, rows of each segment] = x @ W^T for one token; k input features. Returns gguf_matmul's code. */
static int linear1(const int64_t *lin, const float *x, int64_t k, float *out, int64_t n_out, int num_threads) {
    const int64_t n = lin[0];
    if (n < 1 || n > MAX_SEGS) return -1;
    for (int64_t s = 0; s < n; s++) {
        const int64_t *g = lin + 1 + s * SEG_WORDS;
        const int rc = gguf_matmul((const uint8_t *)(intptr_t)g[0], g[1], (int)g[2], g[3], k, x, k, 1, out + g[4],
                                   n_out, 0, num_threads);
        if (rc != 0) return rc;
    }
    return 0;
}

/* hidden [H] float32: the token's embedding in, the final-normed hidden state out. scratch: at least
 * 3 hidden_size + 3 num_heads * D + 2 num_kv_heads * D + 3 intermediate floats (decoder_step.py sizes it).
 * cos_cache / sin_cache [max_position, D/2] float32; block_row: the request's block-table row (int32).
 * Returns 0; -1 for a layout the kernels refuse (a segment, a position outside the cache, G / head_dim over
 * the attention kernel's limits); -2 when a kernel could not allocate its buffer. */
int decoder_step(const int64_t *layers, int64_t n_layers, float *hidden, const float *final_norm, float *scratch,
                 const float *cos_cache, const float *sin_cache, int64_t max_position, const int64_t *position,
                 int64_t slot, int64_t seq_len, const int32_t *block_row, int64_t hidden_size, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, int64_t block_size, float eps,
                 float scale, int num_threads) {
    const int64_t H = hidden_size, Q = num_heads * head_dim, KV = num_kv_heads * head_dim, I = intermediate;
    const int64_t QKV = Q + 2 * KV, zero = 0;
    float *res = scratch, *xn = res + H, *x = xn + H, *qkv = x + H, *qr = qkv + QKV, *ao = qr + Q, *gu = ao + Q,
          *act = gu + 2 * I;
    memcpy(x, hidden, sizeof(float) * (size_t)H);
    int rc;
    for (int64_t l = 0; l < n_layers; l++) {
        const int64_t *L = layers + l * LAYER_WORDS;
        const float *ln_in = (const float *)(intptr_t)L[0], *ln_post = (const float *)(intptr_t)L[1];
        float *kc = (float *)(intptr_t)L[2], *vc = (float *)(intptr_t)L[3];
        if (l == 0) {
            memcpy(res, x, sizeof(float) * (size_t)H);
            rms_norm(x, H, NULL, 0, NULL, 0, xn, H, ln_in, 1, H, eps, 0, 0, num_threads);
        } else {
            rms_norm(x, H, res, H, res, H, xn, H, ln_in, 1, H, eps, 0, 0, num_threads);
        }
        if ((rc = linear1(L + LAYER_HEAD, xn, H, qkv, QKV, num_threads)) != 0) return rc;
        /* RoPE: q into qr, k straight into its cache slot; v copied there */
        if (rotary_neox(position, qkv, QKV, num_heads, qkv + Q, QKV, num_kv_heads, cos_cache, sin_cache,
                        head_dim / 2, max_position, qr, kc + slot * KV, 1, 0, num_threads) != 0)
            return -1;
        memcpy(vc + slot * KV, qkv + Q + KV, sizeof(float) * (size_t)KV);
        if ((rc = paged_decode_attention(qr, Q, kc, vc, ao, Q, block_row, 0, &zero, &zero, &seq_len, 1, num_heads,
                                         num_kv_heads, head_dim, block_size, L[4], scale, 0.f, 0, 0, 1.f,
                                         num_threads)) != 0)
            return rc;
        if ((rc = linear1(L + LAYER_HEAD + LIN_WORDS, ao, Q, x, H, num_threads)) != 0) return rc;
        rms_norm(x, H, res, H, res, H, xn, H, ln_post, 1, H, eps, 0, 0, num_threads);
        if ((rc = linear1(L + LAYER_HEAD + 2 * LIN_WORDS, xn, H, gu, 2 * I, num_threads)) != 0) return rc;
        silu_and_mul(gu, 2 * I, act, I, 1, I, 0, num_threads);
        if ((rc = linear1(L + LAYER_HEAD + 3 * LIN_WORDS, act, I, x, H, num_threads)) != 0) return rc;
    }
    rms_norm(x, H, res, H, res, H, hidden, H, final_norm, 1, H, eps, 0, 0, num_threads);
    return 0;
}
