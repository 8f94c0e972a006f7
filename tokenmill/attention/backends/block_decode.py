"""Decode attention read block by block straight from the paged KV cache (CPU, float32 or bfloat16).

TORCH_SDPA's grouped decode path first copies each decode's K/V blocks into a
padded tensor, then multiplies. On a CPU, decode attention is bound by memory
traffic, and that copy (written, then read again) costs about as much as the
attention itself. Here the keys are used where they lie. A dense run of
physical blocks is one strided view of the cache, and each block is one
[block_size * Hkv, D] matrix, so one batched matmul multiplies every block of
the run by the queries of the decode that owns it:

    physical block   lo  lo+1 lo+2 lo+3 lo+4 lo+5 ...  hi-1
    owner            r3  r3   r3   -    r7   r3   ...  r9     (- = no decode: row B, dropped)

    [n, H, D] @ [n, D, bs * Hkv] -> [n, H, bs * Hkv]   (bfloat16: K @ q^T, the transpose)

Query head h = kv * G + g needs only its own KV head, the diagonal of that
product seen as [n, Hkv, G, bs, Hkv]; the other heads' products are a few
flops on data already in registers (the matmul reads each K block once).
The softmax of a row spans its blocks: the row's max comes from a
scatter_reduce over its blocks' maxima, then exp, the sums and P @ V are
computed per block and added up per row with index_add (a split-KV softmax
at block granularity, as FlashDecoding, Dao et al. 2023, splits long rows).

Blocks outside dense runs (scattered ids) and every further use of a block
shared by several rows (a common prompt prefix) are gathered into one extra
source and go through the same arithmetic. Scores more than 87 below their
row's max are set to -inf before exp (their weight, < exp(-87) ~ 1.6e-38 of the
max's, is below float32 resolution of the row's sum): torch's CPU exp takes a
slow path for arguments that underflow (about 40x slower per element).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Two used blocks at most this many ids apart stay in one run (the gap is computed and dropped).
_MAX_GAP = 4
# A run becomes a view only with at least this many used blocks and at most half of its range unused.
_MIN_RUN = 8
# exp(x) for x < -87 underflows float32 (torch's CPU exp is slow there); such weights become 0.
_EXP_FLOOR = -87.0


@dataclass(slots=True)
class _Source:
    """Blocks whose K/V are read together: a run of the cache (a view) or a gathered list."""

    start: int  # first entry of this source in the plan's concatenated per-block arrays
    n: int  # blocks
    lo: int  # view: physical blocks [lo, lo + n); gathered: -1
    block_ids: torch.Tensor | None  # gathered: [n] int64 physical block ids; view: None

    def kv(self, kv_cache: torch.Tensor, i: int) -> torch.Tensor:
        """Keys (i=0) or values (i=1) of the source's blocks: [n, bs * Hkv, D]."""
        cache = kv_cache[i]
        blocks = cache[self.lo : self.lo + self.n] if self.block_ids is None else cache.index_select(0, self.block_ids)
        return blocks.view(self.n, -1, cache.shape[-1])


@dataclass(slots=True)
class BlockDecodePlan:
    """Where each decode row's keys are, built once per step (and window) and used by every layer.

    Per-block arrays cover all sources, concatenated in source order (N blocks).
    """

    num_rows: int  # decode rows B
    sources: list[_Source]
    owner: torch.Tensor  # [N] int64 decode row using each block; B = none (its results are dropped)
    token: torch.Tensor  # [N] int64 token row of the owner's query (any valid row for owner B)
    bias: torch.Tensor  # [N, 1, 1, bs] float32: 0 where the owner sees the key, -inf where masked
    # Step buffers reused by every layer (allocated at the first layer):
    scores: torch.Tensor | None = None  # k . q for all head pairs: [N, bs * Hkv, H] bf16, [N, H, bs * Hkv] fp32
    # [N, Hkv, G, bs, Hkv] probabilities on the head diagonal; zeros elsewhere stay zero across layers.
    probs: torch.Tensor | None = None
    pv: torch.Tensor | None = None  # [N, H, D] P @ V per block


def plan_block_decode(
    block_table: np.ndarray,  # [num_reqs, max_blocks] int block ids (host)
    reqs: np.ndarray,  # [B] request index of each decode row
    tokens: np.ndarray,  # [B] int64 token row of each decode row's query
    seq_lens: np.ndarray,  # [B] int64 tokens each row attends to (its query is the last)
    block_size: int,
    window: int | None,
) -> BlockDecodePlan:
    """Split the decode rows' block references into dense runs (views) and the rest (one gathered source).

    Row r uses logical blocks [first_r, last_r) of its table row, first_r > 0
    only when a sliding window hides whole blocks. Example, block_size 4,
    seq_lens [16, 24], tables [[10, 11, 12, 13], [14, 16, 17, 18, 19, 500]]:
    ids 10..19 are one run, viewed in place with owners
    [0, 0, 0, 0, 1, B, 1, 1, 1, 1] (block 15 belongs to no decode row), and
    block 500 is gathered (owner 1).
    """
    num_rows = len(reqs)
    first = np.maximum(0, seq_lens - window) // block_size if window else np.zeros_like(seq_lens)
    last = -(-seq_lens // block_size)
    counts = last - first
    # One entry per (row, logical block): counts [2, 3] -> row [0, 0, 1, 1, 1], j = first + [0, 1, 0, 1, 2]
    row = np.repeat(np.arange(num_rows), counts)
    starts = np.cumsum(counts) - counts
    j = first[row] + np.arange(len(row)) - starts[row]
    ids = block_table[reqs[row], j].astype(np.int64)
    key_start = j * block_size

    # The first use of each physical block may go into a view; later uses (shared blocks) are gathered.
    uniq, first_use = np.unique(ids, return_index=True)
    in_view = np.zeros(len(ids), dtype=bool)
    sources: list[_Source] = []
    owners, key_starts = [], []
    total = 0
    cuts = np.flatnonzero(np.diff(uniq) > _MAX_GAP) + 1  # runs of uniq: [0, cut0), [cut0, cut1), ...
    for run in np.split(np.arange(len(uniq)), cuts):
        lo, hi = int(uniq[run[0]]), int(uniq[run[-1]]) + 1
        if len(run) < _MIN_RUN or hi - lo > 2 * len(run):
            continue
        refs = first_use[run]
        in_view[refs] = True
        n = hi - lo
        owner = np.full(n, num_rows, dtype=np.int64)
        owner[ids[refs] - lo] = row[refs]
        start_n = np.zeros(n, dtype=np.int64)
        start_n[ids[refs] - lo] = key_start[refs]
        sources.append(_Source(total, n, lo, None))
        owners.append(owner)
        key_starts.append(start_n)
        total += n
    rest = np.flatnonzero(~in_view)
    if len(rest):
        sources.append(_Source(total, len(rest), -1, torch.from_numpy(ids[rest])))
        owners.append(row[rest])
        key_starts.append(key_start[rest])
    owner = np.concatenate(owners)
    bias = _visibility_bias(owner, np.concatenate(key_starts), seq_lens, block_size, window)
    token = np.append(tokens, tokens[0])[owner]  # owner B reads row 0's query; its results are dropped
    return BlockDecodePlan(num_rows, sources, torch.from_numpy(owner), torch.from_numpy(token), bias)


def _visibility_bias(owner, key_start, seq_lens, block_size, window) -> torch.Tensor:
    """[N, 1, 1, bs] float32. Key k of block b is visible iff key_start[b] + k <= p (the owner's query
    position) and, with a window W, > p - W. Blocks no row owns see everything (their row is dropped)."""
    owned = owner < len(seq_lens)
    qpos = np.where(owned, seq_lens[np.minimum(owner, len(seq_lens) - 1)] - 1, np.iinfo(np.int64).max)
    kpos = key_start[:, None] + np.arange(block_size)[None]  # [N, bs]
    visible = kpos <= qpos[:, None]
    if window is not None:
        visible &= (kpos > qpos[:, None] - window) | ~owned[:, None]
    bias = np.where(visible, np.float32(0), np.float32(-np.inf))[:, None, None, :]
    return torch.from_numpy(np.ascontiguousarray(bias))


def block_decode_attention(
    query: torch.Tensor,  # [T, H, D] float32 or bfloat16, the step's queries
    kv_cache: torch.Tensor,  # [2, num_blocks, bs, Hkv, D], query's dtype
    plan: BlockDecodePlan,
    scale: float,
    cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each decode row over its keys in the cache; returns [B, H, D] float32.

    `cap`: soft-capping of the scores, cap * tanh(scores / cap) (Gemma-2), or None.
    `sinks`: [H] per-head logit that joins every row's max and softmax
    denominator and adds no value (gpt-oss), or None.
    All sources go through one softmax pipeline over their concatenated
    blocks; only the two matmuls (and a gathered source's copy) are per source.
    The matmuls run in the cache's dtype (bfloat16: oneDNN/AMX); the softmax,
    the per-row sums and the result are float32. With bfloat16 the scores
    are rounded to bfloat16 once, as HF's eager attention rounds them.
    """
    num_rows, num_blocks = plan.num_rows, plan.owner.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    width = block_size * num_kv_heads
    dtype = kv_cache.dtype
    # bfloat16: K @ q^T, the cache block as the matmul's left operand, which oneDNN reads as it lies (a
    # right operand is first reordered for AMX); 30 layers' caches, one thread: 1.0 vs 1.3 ms per layer.
    # float32 (MKL): q @ K^T, a few % faster there.
    keys_left = dtype == torch.bfloat16
    shape = (num_blocks, width, num_heads) if keys_left else (num_blocks, num_heads, width)
    if plan.scores is None or plan.scores.shape != shape or plan.scores.dtype != dtype:
        plan.scores = kv_cache.new_empty(shape)
        plan.probs = kv_cache.new_zeros(num_blocks, num_kv_heads, group, block_size, num_kv_heads)
        plan.pv = kv_cache.new_empty(num_blocks, num_heads, head_dim)
    assert plan.probs is not None and plan.pv is not None
    q = query.index_select(0, plan.token).to(dtype)  # [N, H, D]: each block's owner's query
    for src in plan.sources:
        end = src.start + src.n
        k, qs = src.kv(kv_cache, 0), q[src.start : end]
        if keys_left:
            torch.bmm(k, qs.transpose(1, 2), out=plan.scores[src.start : end])
        else:
            torch.bmm(qs, k.transpose(1, 2), out=plan.scores[src.start : end])
    # Key head kv meets the query heads of kv on the diagonal of the all-pairs product:
    # [N, bs * Hkv, H] as [N, bs, Hkv, Hkv, G], or [N, H, bs * Hkv] as [N, Hkv, G, bs, Hkv].
    if keys_left:
        diag = plan.scores.view(num_blocks, block_size, num_kv_heads, num_kv_heads, group).diagonal(dim1=2, dim2=3)
        diag = diag.permute(0, 3, 2, 1)  # [N, Hkv, G, bs], a strided view
    else:
        diag = plan.scores.view(num_blocks, num_kv_heads, group, block_size, num_kv_heads).diagonal(dim1=1, dim2=4)
        diag = diag.permute(0, 3, 1, 2)
    # A plain copy out of the strided view, then the arithmetic in place: one broadcasting add straight
    # from the view runs ~4x slower (torch picks a poor loop order for it).
    s = plan.bias.new_empty(diag.shape).copy_(diag)
    if cap is None:
        s = torch.add(plan.bias, s, alpha=scale, out=s)  # bias + scale * qk
    else:
        s = s.mul_(scale / cap).tanh_().mul_(cap).add_(plan.bias)
    s = s.view(num_blocks, num_heads, block_size)
    owner = plan.owner
    row_max = s.new_full((num_rows + 1, num_heads), float("-inf"))
    row_max.scatter_reduce_(0, owner[:, None].expand(num_blocks, num_heads), s.amax(dim=-1), "amax")
    if sinks is not None:
        row_max = torch.maximum(row_max, sinks.float()[None])
    s = s.sub_(row_max.index_select(0, owner)[:, :, None])
    p = F.threshold(s, _EXP_FLOOR, float("-inf"), inplace=True).exp_()  # [N, H, bs] float32
    denom = s.new_zeros(num_rows + 1, num_heads).index_add_(0, owner, p.sum(dim=-1))
    if sinks is not None:
        denom += torch.exp(sinks.float()[None] - row_max)
    # P @ V over all KV heads at once: P placed on the diagonal of [N, Hkv, G, bs, Hkv], zeros elsewhere.
    plan.probs.diagonal(dim1=1, dim2=4).copy_(p.view(num_blocks, num_kv_heads, group, block_size).permute(0, 2, 3, 1))
    probs = plan.probs.view(num_blocks, num_heads, width)
    for src in plan.sources:
        end = src.start + src.n
        torch.bmm(probs[src.start : end], src.kv(kv_cache, 1), out=plan.pv[src.start : end])
    acc = s.new_zeros(num_rows + 1, num_heads, head_dim).index_add_(0, owner, plan.pv.float())
    return acc[:num_rows] / denom[:num_rows, :, None]
