"""Sort a step's (token, expert) pairs by expert for the fused-MoE grouped GEMMs, in one or two Triton launches.

Layout (`moe_align_block_size`): pair p = token * top_k + slot; the pairs of
each expert, in increasing p (a stable sort), start at a multiple of
BLOCK_M and their run is padded to a multiple of BLOCK_M with the marker
num_pairs, so that every BLOCK_M-row tile holds one expert's pairs:

    experts of pairs  [2, 0, 0, 1]  (BLOCK_M 2)
    counts            [2, 1, 1]  -> tiles [1, 1, 1] -> padded starts [0, 2, 4]
    sorted_pair_ids   [1, 2 | 3, P | 0, P]   (P = 4, the padding marker)
    tile_expert_ids   [0, 1, 2]

How the Triton path gets there without sorting. The pairs are cut into
chunks of CHUNK. In a chunk, a pair's rank among the earlier pairs of its
expert is a count over a [CHUNK, SUB] equality matrix (SUB columns at a
time), and the last pair of each expert writes the chunk's count of that
expert (rank + 1) into a per-chunk histogram row. The pair then lands at

    padded_start[expert] + (pairs of its expert in earlier chunks) + rank,

which needs the histogram rows of all chunks: launch 1 writes them (one
program per chunk), launch 2 (one program per chunk again) sums them,
takes the prefix sum over experts of the padded counts and scatters its
chunk's pairs. Each program of launch 2 also owns a slice of the tiles: it
writes their experts (`searchsorted` as a count of tile ends <= tile) and
the padding marker into their slots past their expert's pairs, so no slot
is written twice and no memset is needed. With one chunk (num_pairs <=
CHUNK: decode) a single program does both, one launch.

Written for tokenmill from the layout's definition (the same layout as
vLLM's `moe_align_block_size`); `moe_align_block_size_torch` is the plain
PyTorch statement of it (the test reference and the fallback for more than
`MAX_TRITON_EXPERTS` experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Per-expert vectors live in registers of one program (E padded to a power of two).
MAX_TRITON_EXPERTS = 1024
CHUNK = 256  # pairs per program; one launch up to this many pairs
SUB = 32  # columns of the equality matrix per step ([CHUNK, SUB] booleans in registers)
TILE_BLOCK = 32  # tiles per step when writing tile experts and padding


def max_tiles_for(num_pairs: int, block_m: int, num_experts: int) -> int:
    """Static bound on the tile count: sum_e ceil(c_e / m) <= (P + min(E, P) * (m - 1)) // m, at least 1."""
    return max(1, (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)


@triton.jit
def _count_chunk(ids_ptr, counts_ptr, ranks_ptr, chunk, num_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                 SUB: tl.constexpr):
    """Ranks of the chunk's pairs inside their expert (-> ranks_ptr) and the chunk's histogram row (-> counts_ptr)."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    before = tl.zeros([CHUNK], dtype=tl.int32)
    after = tl.zeros([CHUNK], dtype=tl.int32)
    for s in range(CHUNK // SUB):  # a loop, not unrolled: CHUNK / SUB copies of a [CHUNK, SUB] step would be large
        q = chunk * CHUNK + s * SUB + tl.arange(0, SUB)
        q_ids = tl.load(ids_ptr + q, mask=q < num_pairs, other=-2).to(tl.int32)
        same = ids[:, None] == q_ids[None, :]
        before += tl.sum((same & (q[None, :] < offs[:, None])).to(tl.int32), axis=1)
        after += tl.sum((same & (q[None, :] > offs[:, None])).to(tl.int32), axis=1)
    tl.store(ranks_ptr + offs, before, mask=mask)
    row = counts_ptr + chunk * E_PAD
    tl.store(row + tl.arange(0, E_PAD), tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()  # the zeros land before the counts (same addresses, other threads)
    tl.store(row + ids, before + 1, mask=mask & (after == 0))


@triton.jit(do_not_specialize=["num_pairs"])
def align_count_kernel(ids_ptr, counts_ptr, ranks_ptr, num_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                       SUB: tl.constexpr):
    """Launch 1 (several chunks): one program per chunk writes its ranks and histogram row."""
    _count_chunk(ids_ptr, counts_ptr, ranks_ptr, tl.program_id(0), num_pairs, E_PAD, CHUNK, SUB)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_tiles", "tiles_per_program"])
def align_scatter_kernel(
    ids_ptr,  # [num_pairs] expert of each pair (any integer dtype)
    counts_ptr,  # [num_chunks, E_PAD] int32 histogram rows (launch 1, or this program when FUSED)
    ranks_ptr,  # [num_pairs] int32 rank of each pair among its chunk's pairs of its expert
    base_ptr,  # [num_chunks, E_PAD] int32 scratch: where each chunk's pairs of an expert start
    sorted_ptr,  # [max_tiles * BLOCK_M] int32 out
    tile_expert_ptr,  # [max_tiles] int32 out
    num_post_ptr,  # [1] int32 out
    num_pairs,
    num_experts,
    num_chunks,
    max_tiles,
    tiles_per_program,
    FUSED: tl.constexpr,  # one program, one chunk: count here first
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    ROWS: tl.constexpr,  # histogram rows summed per step
    TILE_BLOCK: tl.constexpr,
):
    """Launch 2: one program per chunk scatters its pairs and writes its slice of tile experts and padding."""
    c = tl.program_id(0)
    if FUSED:
        _count_chunk(ids_ptr, counts_ptr, ranks_ptr, c, num_pairs, E_PAD, CHUNK, SUB)
        tl.debug_barrier()
    e = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        cnt = tl.load(counts_ptr + rows[:, None] * E_PAD + e[None, :], mask=rows[:, None] < num_chunks, other=0,
                      cache_modifier=".cg")
        total += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where(rows[:, None] < c, cnt, 0), axis=0)
    tiles = (total + BLOCK_M - 1) // BLOCK_M  # experts past num_experts have total 0
    tile_ends = tl.cumsum(tiles, axis=0)
    padded_starts = (tile_ends - tiles) * BLOCK_M
    # Pairs of this chunk: base of their expert (through memory: a gather by expert id) plus their rank.
    tl.store(base_ptr + c * E_PAD + e, padded_starts + before)
    tl.debug_barrier()
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    # .cg: read from L2 what this program (FUSED) or launch 1 just wrote.
    pos = (tl.load(base_ptr + c * E_PAD + ids, mask=mask, other=0, cache_modifier=".cg")
           + tl.load(ranks_ptr + offs, mask=mask, other=0, cache_modifier=".cg"))
    tl.store(sorted_ptr + pos, offs, mask=mask)
    # Tiles [c * tiles_per_program, ...): expert = #experts whose tile end <= tile (searchsorted, right=True),
    # clamped to the last expert past the padded total; padding marker in the slots past the expert's pairs.
    ends = tl.where(e < num_experts, tile_ends, 2147483647)
    first = c * tiles_per_program
    for t0 in range(0, tiles_per_program, TILE_BLOCK):
        t = first + t0 + tl.arange(0, TILE_BLOCK)
        t_mask = (t0 + tl.arange(0, TILE_BLOCK) < tiles_per_program) & (t < max_tiles)
        te = tl.minimum(tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1), num_experts - 1)
        tl.store(tile_expert_ptr + t, te, mask=t_mask)
        hot = e[None, :] == te[:, None]
        t_start = tl.sum(tl.where(hot, padded_starts[None, :], 0), axis=1)
        t_count = tl.sum(tl.where(hot, total[None, :], 0), axis=1)
        slot = t[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        is_pad = slot - t_start[:, None] >= t_count[:, None]
        tl.store(sorted_ptr + slot, tl.zeros([TILE_BLOCK, BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=t_mask[:, None] & is_pad)
    if c == 0:
        tl.store(num_post_ptr, tl.sum(tiles, axis=0) * BLOCK_M)


def moe_align_block_size_torch(topk_ids: torch.Tensor, block_m: int,
                               num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align_block_size` in ~10 PyTorch ops (any device, any size); the reference of the Triton path."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without a device->host size sync
    tiles = (counts + block_m - 1) // block_m
    padded_ends = torch.cumsum(tiles * block_m, 0)
    padded_starts = padded_ends - tiles * block_m
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    # Rank of each sorted pair inside its expert's run: [0, 1, 0, 0] for experts [0, 0, 1, 2].
    unpadded_starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - unpadded_starts[expert_of_sorted]
    max_tiles = max_tiles_for(num_pairs, block_m, num_experts)
    sorted_pair_ids = torch.full((max_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[padded_starts[expert_of_sorted] + rank] = order.to(torch.int32)
    tile_ends = torch.cumsum(tiles, 0)
    tile_expert_ids = torch.searchsorted(tile_ends, torch.arange(max_tiles, device=device), right=True)
    tile_expert_ids = tile_expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pair_ids, tile_expert_ids, padded_ends[-1:].to(torch.int32)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                         chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, expert) pairs by expert, each expert's run padded to a multiple of `block_m`.

    Pair p = token * top_k + slot. No host sync and CUDA-graph safe: the
    output sizes are upper bounds that depend only on shapes. One Triton
    launch up to `chunk` pairs, two above (module docstring); the PyTorch
    statement (`moe_align_block_size_torch`) for more than
    MAX_TRITON_EXPERTS experts. Both give the same tensors bit for bit.

    Args:
        topk_ids: [T, top_k] integer expert ids in [0, num_experts) (contiguous or not).
        block_m: rows per tile, a power of two (>= 16 for the grouped GEMMs).
        chunk: pairs per program (a power of two, a multiple of 32); tests and tuning.

    Returns:
        sorted_pair_ids: [max_tiles * block_m] int32; pair ids grouped by
            expert (stable order inside an expert), `T * top_k` marks padding.
        tile_expert_ids: [max_tiles] int32, the expert of each tile (tiles
            past the padded total repeat the last expert and are skipped).
        num_pairs_post_padded: [1] int32, the padded total.

    Example (block_m = 2): topk_ids [[2, 0], [0, 1]] -> pairs' experts
    [2, 0, 0, 1], counts [2, 1, 1] -> padded [2, 2, 2] ->
    sorted_pair_ids [1, 2, 3, 4, 0, 4], tile_expert_ids [0, 1, 2],
    num_pairs_post_padded [6].
    """
    if num_experts > MAX_TRITON_EXPERTS:
        return moe_align_block_size_torch(topk_ids, block_m, num_experts)
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_tiles = max_tiles_for(num_pairs, block_m, num_experts)
    sorted_pair_ids = torch.empty(max_tiles * block_m, dtype=torch.int32, device=device)
    tile_expert_ids = torch.empty(max_tiles, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    num_chunks = max(1, triton.cdiv(num_pairs, chunk))
    # One scratch allocation: histogram rows, chunk bases, ranks.
    scratch = torch.empty(2 * num_chunks * e_pad + max(num_pairs, 1), dtype=torch.int32, device=device)
    counts = scratch[:num_chunks * e_pad]
    bases = scratch[num_chunks * e_pad:2 * num_chunks * e_pad]
    ranks = scratch[2 * num_chunks * e_pad:]
    fused = num_chunks == 1
    sub = min(SUB, chunk)
    # [chunk, SUB] equality tiles: 64 rows per warp keep them in registers (sm_90 ptxas: chunk 1024 on 4 warps spills).
    warps = max(4, min(16, chunk // 64))
    if not fused:
        align_count_kernel[(num_chunks,)](flat, counts, ranks, num_pairs, E_PAD=e_pad, CHUNK=chunk, SUB=sub,
                                          num_warps=warps)
    align_scatter_kernel[(num_chunks,)](
        flat, counts, ranks, bases, sorted_pair_ids, tile_expert_ids, num_post,
        num_pairs, num_experts, num_chunks, max_tiles, triton.cdiv(max_tiles, num_chunks),
        FUSED=fused, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, SUB=sub,
        ROWS=max(1, min(triton.next_power_of_2(num_chunks), 4096 // e_pad)), TILE_BLOCK=TILE_BLOCK, num_warps=warps,
    )
    return sorted_pair_ids, tile_expert_ids, num_post
