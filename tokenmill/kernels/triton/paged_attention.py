"""Triton kernel: varlen causal attention over the paged KV cache.

One kernel serves a mixed step of prefill chunks and decodes. Request i owns
new tokens `query_start_loc[i] : query_start_loc[i+1]` and attends to its first
`seq_lens[i]` cached tokens (the new keys/values are written first):

    request i:  | context (c = seq_len - query_len) | new (query_len) |
    new token j sits at position c + j and sees positions [0, c + j]
    (with a sliding window W: (c + j - W, c + j]).

Work split. A program handles one "query block" (BLOCK_Q consecutive new
tokens of one request) for one kv head, times the `num_queries_per_kv` query
heads that share that kv head (GQA/MQA), so every K/V tile is loaded once per
group. Its tile rows are (token, head) pairs:

    row r -> token q0 + r // QPK_PAD, query head kv_head * qpk + r % QPK_PAD
    BLOCK_M = BLOCK_Q * QPK_PAD rows; rows with a padded head or a token past
    the request's end are masked.

Query blocks are numbered without a host pass: request i's blocks start at
`query_start_loc[i] // BLOCK_Q + i`. That numbering is monotone and leaves
room for ceil(query_len / BLOCK_Q) blocks per request (floor(b) - floor(a) + 1
>= ceil(b - a)), so a program binary-searches `query_start_loc` for its
request and the grid size `num_tokens // BLOCK_Q + num_reqs + 1` depends only
on host ints. Example with BLOCK_Q = 4, query lens [3, 1, 6]:

    query_start_loc [0, 3, 4, 10] -> first block per request [0, 1, 3], pad 5
    pid:     0   1   2        3    4        5
    request: 0   1   1(idle)  2    2(j>=4)  pad (tokens past 10, zeros)

Tokens past `query_start_loc[num_reqs]` (CUDA-graph padding) belong to a
virtual last request with no context; their output rows are written as 0.
A request with no new tokens (a mixed CUDA graph's empty requests: query
length 0, seq_len 0) owns one idle block, which writes nothing: it has no
rows.

Mixed steps: two launches (`split_decodes`, the default). A 64-row tile
spends most of its rows on nothing for a decode (Llama-3.1-8B: 1 token x 4
heads real out of 16 x 4), and a mixed step is mostly decodes, so when
max_query_len > 4 the same kernel runs twice over the same buffers, each
program of either launch writing its rows or nothing:

    ROLE 1 (decode):  the decode-step tiles (`choose_decode_launch_config`,
                      16 rows: BLOCK_Q_dec = max(16 // QPK_PAD, 1) tokens);
                      grid num_reqs x kv heads in request order, program ->
                      request directly, q0 = 0. Takes the requests of
                      1..BLOCK_Q_dec new tokens (one block each); programs of
                      longer or empty requests return at once.
    ROLE 2 (prefill): the step's 64-row tiles, numbering and launch order;
                      blocks of requests of <= BLOCK_Q_dec tokens (DECODE_Q)
                      return at once, except the virtual padding request's,
                      which writes its zero rows whatever its length.

Example, BLOCK_Q_dec = 4, query lens [1, 0, 9, 3] + 2 padding tokens: ROLE 1
writes requests 0 and 3; ROLE 2 writes request 2 and the padding rows;
request 1 has no rows. So every output row is written by exactly one launch
(with split KV, which mixed steps do not choose, every split of it). Both
grids depend on host ints only, so a CUDA graph of a mixed step replays
both. ROLE 0 (one launch: decode-only steps, and `split_decodes=False`) is
the kernel without either check (the same PTX as before the roles).

Launch order (HEAVY_FIRST, the default): grid axis 0 enumerates (query block,
kv head) pairs with the head fastest and the blocks in reverse, so the GPU
hands out a request's last query blocks (the most keys under the causal
mask) first and the short ones fill in behind them (longest-job-first, as
FlashAttention-2 orders causal blocks), instead of ending the step on a tail
of long programs. The order changes which program computes what, never the
result; HEAVY_FIRST = False keeps blocks in request order (for A/B timing).

The KV loop walks BLOCK_N positions at a time and gathers each position's
physical block from `block_table`, so BLOCK_N and the cache block size are
independent (any block size works; the engine uses powers of two >= 16).
Only tiles reaching past the block's first token need the causal mask.
Softmax is the online (streaming) form of FlashAttention (Dao et al. 2022,
Alg. 1) in fp32, in base 2 (exp2 with log2(e) folded into the scale).

Attention sinks (gpt-oss): head h's softmax denominator gains exp(sink[h])
(the sink logit is in the units of the scaled scores and has no value row).
Without splits the kernel adds it after the KV loop, rescaling to
max(m, sink) first; with splits each split leaves its plain partial result
and `merge_splits` adds the sink once, as one more split with o = 0.

fp8 KV cache (`--kv-cache-dtype fp8*`): the kernel loads the cache's uint8
bits and decodes each K/V tile exactly into the query's dtype
(`triton/kv_fp8.decode_kv`, integer bit operations, so cc 7.0 and the
interpreter run it too). The layer's scales are folded in on the host:
the score scale becomes scale * k_scale * unit and the output is multiplied
by v_scale * unit before the division by l (unit = 256 for e4m3's bit decode,
1 for e5m2), so dots run on the fp8 values themselves and the result equals
attention over the dequantized cache up to float rounding. The decode is
where an fp8 cache's time goes (a full decode batch reads ~5e10 cache values
a step on Llama-3.1-8B), so on cc >= 8.9 KV_NATIVE uses the conversion
instructions (two values each) instead of the bit operations, and with
bfloat16 queries Q_F16 runs both dots in float16, which the decoded values
already are (a float16 -> bfloat16 cast costs two conversions a value): each
query row is multiplied by the power of two 2^-e that brings its largest
|q| into [0.5, 1) before its float16 rounding, and 2^e joins that row's score
scale. The rounding is exact for every element within 2^-14 of its row's
largest (bfloat16 keeps 8 significant bits); smaller ones, whose products
are below 2^-14 of the row's largest, keep fewer bits. P is rounded to
float16 for the P @ V dot (3 more bits than bfloat16).

Small decode batches split each KV range over grid axis 1 (flash-decoding);
each split writes a partial result and its log-sum-exp, and
`merge_splits` combines them. Tile sizes and the split count are chosen
in `attention_config` from host ints only.

The host side (argument checks, split-KV buffers, the launches, the merge)
is `paged_attention_launch.paged_attention`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.kv_fp8 import decode_kv


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "sliding_window", "num_q_blocks"])
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]; SPLIT_KV: fp32 [num_splits, num_tokens, num_heads, head_dim]
    lse_ptr,  # SPLIT_KV only: fp32 [num_splits, num_tokens, num_heads], log2-sum-exp2 of each split
    q_ptr,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]; KV_FP8: its uint8 bits
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    sinks_ptr,  # [num_heads] fp32 per-head sink logits, read when USE_SINKS (and not SPLIT_KV)
    scale,  # fp32 softmax scale (KV_FP8: times k_scale * unit, see the module docstring)
    v_scale,  # fp32, KV_FP8 only: v_scale * unit, multiplies the output
    softcap,  # fp32, used when USE_SOFTCAP
    sliding_window,  # i32, used when USE_WINDOW
    num_reqs,
    num_tokens,
    stride_q_tok,
    stride_q_head,
    stride_o_split,
    stride_o_tok,
    stride_o_head,
    stride_lse_split,
    stride_lse_tok,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_req,
    num_queries_per_kv,
    head_dim,
    num_kv_heads,
    num_q_blocks,  # grid axis 0 is num_q_blocks * num_kv_heads
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,  # new tokens per program
    QPK_PAD: tl.constexpr,  # next power of two >= num_queries_per_kv
    BLOCK_M: tl.constexpr,  # BLOCK_Q * QPK_PAD
    BLOCK_N: tl.constexpr,  # KV positions per loop step
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= head_dim (>= 16)
    EVEN_D: tl.constexpr,  # head_dim == HEAD_DIM_PAD (no mask along the head dimension)
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    NUM_SPLITS: tl.constexpr,  # KV range split over grid axis 2 (flash-decoding); 1 = off
    SPLIT_KV: tl.constexpr,  # NUM_SPLITS > 1: write partial results + lse for merge_splits
    KV_FP8: tl.constexpr,  # 0: cache in the query's dtype; 1 / 2: e4m3fn / e5m2 bits (triton/kv_fp8.py)
    KV_NATIVE: tl.constexpr,  # KV_FP8 only: decode with the fp8 conversion instructions (cc >= 8.9)
    Q_F16: tl.constexpr,  # KV_FP8 with bfloat16 queries: dots in float16, queries scaled per row (docstring)
    HEAVY_FIRST: tl.constexpr,  # axis 0 runs the query blocks last to first (module docstring)
    ROLE: tl.constexpr,  # 0: the only launch; 1 / 2: decode / prefill launch of a mixed step (module docstring)
    DECODE_Q: tl.constexpr,  # ROLE 2: requests with q_len <= DECODE_Q are the decode launch's
):
    flat = tl.program_id(0)
    kv_head = flat % num_kv_heads
    pid = flat // num_kv_heads  # query block (ROLE 1: request)
    if HEAVY_FIRST:
        pid = num_q_blocks - 1 - pid
    split = tl.program_id(1)
    LOG2E: tl.constexpr = 1.4426950408889634

    if ROLE == 1:
        req = pid  # one block per request, grid num_reqs: never the padding request
    else:
        # Largest request index r in [0, num_reqs] whose first query block <= pid;
        # r == num_reqs is the virtual padding request.
        left = pid * 0
        right = pid * 0 + num_reqs
        while left < right:
            mid = (left + right + 1) // 2
            first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            ok = first <= pid
            left = tl.where(ok, mid, left)
            right = tl.where(ok, right, mid - 1)
        req = left
    is_pad = req == num_reqs

    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1, mask=req < num_reqs, other=0)
    q_end = tl.where(is_pad, num_tokens, q_end)
    q_len = q_end - q_start
    if ROLE == 1:
        # Longer requests are the prefill launch's; empty ones have no rows to write.
        if (q_len == 0) | (q_len > BLOCK_Q):
            return
    if ROLE == 2:
        # Short requests are the decode launch's; the padding request (zero rows) stays here.
        if (q_len <= DECODE_Q) & (req < num_reqs):
            return
    seq_len = tl.load(seq_lens_ptr + req, mask=req < num_reqs, other=0)
    ctx_len = seq_len - q_len
    if ROLE == 1:
        q0 = pid * 0
    else:
        q0 = (pid - (q_start // BLOCK_Q + req)) * BLOCK_Q  # first token of this block, within the request

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tok = q0 + offs_m // QPK_PAD
    head_in_group = offs_m % QPK_PAD
    head = kv_head * num_queries_per_kv + head_in_group
    row_valid = (tok < q_len) & (head_in_group < num_queries_per_kv)
    # A head_dim mask known at compile time (EVEN_D: head_dim == HEAD_DIM_PAD) keeps the K/V loads vectorized,
    # which Triton's pipeliner needs to turn them into cp.async copies (a runtime mask along the contiguous
    # dimension made them element-wise, synchronous loads).
    d_valid = (offs_d < HEAD_DIM_PAD) if EVEN_D else (offs_d < head_dim)
    tok_global = (q_start + tok).to(tl.int64)
    io_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(
        q_ptr + tok_global[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    q_pos = ctx_len + tok  # absolute position of each row's token
    # The score scale per row: `scale`, or with Q_F16 scale * 2^e where q / 2^e is the row in float16.
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * scale
    if Q_F16:
        # 2^e > max |q| of the row, from its float32 exponent field E: 2^-e has field 253 - E (exact, no exp2).
        q32 = q.to(tl.float32)
        q_exp = (tl.max(tl.abs(q32), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
        q_mul = ((253 - tl.minimum(q_exp, 252)) << 23).to(tl.float32, bitcast=True)
        q = (q32 * q_mul[:, None]).to(tl.float16)
        row_scale = row_scale / q_mul

    # KV positions any row of this block can see: [kv_begin, kv_end).
    last_tok = tl.minimum(q0 + BLOCK_Q, q_len) - 1
    kv_end = tl.where(is_pad | (q0 >= q_len), 0, ctx_len + last_tok + 1)
    kv_begin = kv_end * 0
    if USE_WINDOW:
        kv_begin = tl.maximum(ctx_len + q0 - sliding_window + 1, 0)
    kv_begin = tl.minimum((kv_begin // BLOCK_N) * BLOCK_N, kv_end)  # idle blocks: empty range
    loop_begin = kv_begin
    loop_end = kv_end
    if SPLIT_KV:
        # Split s takes tiles [s * per, (s + 1) * per) of the block's range; a
        # split past the end gets an empty loop and writes l = 0 (lse = -inf).
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, BLOCK_N), NUM_SPLITS)
        loop_begin = kv_begin + split * tiles_per_split * BLOCK_N
        loop_end = tl.minimum(loop_begin + tiles_per_split * BLOCK_N, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Positions [0, full_end) are visible to every row of the block (its first
    # token sits at ctx_len + q0); 0 for idle/padding blocks, which never loop.
    full_end = tl.minimum(ctx_len + q0 + 1, kv_end)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    head_off = kv_head.to(tl.int64) * stride_c_head

    for start_n in range(loop_begin, loop_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        block_id = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot_off = block_id * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot + head_off
        kv_mask = (n_valid[:, None] & d_valid[None, :]) if not EVEN_D else n_valid[:, None]
        k = tl.load(kv_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(kv_cache_ptr + stride_c_kv + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        if KV_FP8:  # exact: every fp8 value is a float16 / bfloat16 / float32 number
            k = decode_kv(k, KV_FP8, KV_NATIVE).to(q.dtype)
            v = decode_kv(v, KV_FP8, KV_NATIVE).to(q.dtype)
        # k, v: [BLOCK_N, HEAD_DIM_PAD], rows contiguous in memory

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N] fp32
        if USE_SOFTCAP:
            # cap * tanh(x / cap) with tanh(y) = sign(y) (1 - e^{-2|y|}) / (1 + e^{-2|y|}):
            # never overflows, unlike the (e^{2y} - 1) / (e^{2y} + 1) form.
            y = s * row_scale[:, None] / softcap
            t = tl.exp2(-2.0 * LOG2E * tl.abs(y))
            th = (1.0 - t) / (1.0 + t)
            s = tl.where(y < 0, -th, th) * (softcap * LOG2E)
        else:
            s = s * (row_scale * LOG2E)[:, None]
        if USE_WINDOW:
            visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
        elif start_n + BLOCK_N > full_end:
            # Only tiles reaching past what the block's first token sees need the
            # causal / length mask; earlier tiles are visible to every row.
            visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so
        # exp2 gives 0, not NaN from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if USE_SINKS and not SPLIT_KV:
        # exp(sink) joins the denominator: rescale acc and l to m_fin = max(m, sink) first. Rows that saw no
        # key (m = -inf) get corr = 0, so their output stays 0.
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        corr = tl.exp2(m_i - m_fin)
        l_i = l_i * corr + tl.exp2(sink - m_fin)
        acc = acc * corr[:, None]
    if KV_FP8:
        acc = acc * v_scale
    # Rows with no visible key (padding rows, empty splits) have l == 0 -> output 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    row_off = split * stride_o_split + tok_global * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + row_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
    if SPLIT_KV:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        lse_off = split * stride_lse_split + tok_global * stride_lse_tok + head
        tl.store(lse_ptr + lse_off, lse, mask=row_valid)
