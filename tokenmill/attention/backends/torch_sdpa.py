"""TORCH_SDPA: the reference paged-attention backend, in plain PyTorch ops.

Runs wherever PyTorch runs (CPU, any CUDA GPU including cc 7.0). Each step:

1. write the new keys/values into the paged cache at `slot_mapping`;
2. attend, per request, over the request's blocks:

       request i:  | cached (context_len) | new (query_len) |
                   |<------------- seq_len --------------->|

   new token j (absolute position p = context_len + j) sees key positions
   k with k <= p, and with a sliding window W also k > p - W (HF's mask).

On CPU in float32 and bfloat16, the decodes (query_len 1) of a step are read
straight from the cache, without a gathered copy of their K/V: by the C
kernel of `tokenmill.kernels.cpu.decode` where it builds (64 decodes of
~175 keys, SmolLM2 bfloat16, 2 threads: 0.56 vs 2.0 ms per layer), else
block by block in PyTorch (`block_decode`; offline_throughput decode step,
SmolLM2, one thread: 20% less attention time in float32; bfloat16 batch-64
decode step ~300 -> ~210 ms).
Elsewhere, decodes are sorted by length and cut into groups of
about `decode_group_keys` gathered keys (rows x padded keys); each group is
one padded gather and one batched matmul. Similar lengths keep the padding
small, and a group's gathered K/V stays in the CPU's L2 cache between the
gather and the two matmuls (64 decodes of 150-530 tokens: 25 -> 16 ms per
layer on one core). Each prefill chunk is attended on its own. When a request's
keys do not fit one tile (`kv_tile_size` keys), the keys are visited in
tiles with an online softmax (running max `m` and sum `l`; Milakov &
Gimelshein 2018, arXiv:1805.02867; FlashAttention, Dao et al. 2022), so no
score tensor is larger than [heads, query_len, tile] per request.
A fresh prompt, and a chunk whose cached context and itself fit one tile
(no soft-cap), go straight to `torch.nn.functional.scaled_dot_product_attention`
(the chunk with its tile's mask), whose fused CPU/CUDA kernels are themselves tiled.

Attention sinks (gpt-oss: one logit per head that joins the softmax
denominator as exp(sink) and carries no value) are supported by the
block-by-block decode and the tiled path; a sink layer skips the C decode
kernel and torch's fused SDPA (neither can add a term to its denominator)
and takes those instead: decodes from the cache via `block_decode`, prefill
chunks via the tiles below.

An fp8 KV cache (`--kv-cache-dtype fp8*`, `kernels/kv_fp8.py`) is written as
k / k_scale and v / v_scale rounded to fp8. Decodes read it in place with the
C kernel (which decodes fp8 itself) where it builds, else through the grouped
gathers (`block_decode` reads 16/32-bit caches only); prefill chunks through
their tiles. Gathered fp8 K/V are cast exactly to the query's dtype, the
score scale becomes scale * k_scale and the output is multiplied by v_scale. A fresh prompt then also attends over its
stored (fp8) K/V instead of the step's 16-bit ones, so a prefix-cache hit and
a fresh prefill see the same keys (as TRITON_ATTN, which always reads the
cache).

Everything that depends only on the step's metadata (which blocks each
group reads, the causal/window masks as additive biases) is planned once per
step and window, on the first layer, and reused by every other layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.attention.backends.block_decode import BlockDecodePlan, block_decode_attention, plan_block_decode
from tokenmill.attention.backends.fused_sdpa import chunk_sdpa, fresh_prefill_sdpa
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.dtypes import is_fp8
from tokenmill.kernels.cpu import decode as cpu_decode, elementwise as cpu_elementwise
from tokenmill.kernels.kv_fp8 import gather_blocks, store_kv

# CPU cache dtypes that block_decode reads in place (its matmuls run in the cache's dtype).
_BLOCK_DECODE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class _Tile:
    block_ids: torch.Tensor  # [B * nbt] int64 physical blocks, row-major over (row, block)
    # [B, 1, 1, Q, T] float32: 0 where visible, -inf where masked; None when every key of
    # the tile is visible to every query (tiles wholly before a chunk need no mask, so a
    # long context costs no [Q, context] mask, only masks of the tiles it overlaps).
    bias: torch.Tensor | None


@dataclass(slots=True)
class _Group:
    """Query rows attended together: the decode batch (B rows, Q = 1) or one prefill chunk (B = 1)."""

    tiles: list[_Tile] | None  # None until first needed (fresh prompts usually take the SDPA path)
    tile_args: tuple = ()  # _plan_tiles arguments, to build `tiles` lazily
    tokens: torch.Tensor | None = None  # decode batch: [B] token rows
    start: int = 0  # prefill chunk: token rows [start, end)
    end: int = 0
    fresh: bool = False  # prefill with no cached context (SDPA fast path when allowed)

    def get_tiles(self) -> list[_Tile]:
        if self.tiles is None:
            self.tiles = _plan_tiles(*self.tile_args)
        return self.tiles


@dataclass(slots=True)
class _Plan:
    md: AttentionMetadata  # kept alive so identity comparison is safe
    window: int | None
    with_kernel: bool = False  # decodes go to the C kernel (part of the plan's key, with the window)
    decodes: list[_Group] = field(default_factory=list)  # decode rows grouped by length
    prefills: list[_Group] = field(default_factory=list)
    # CPU float32/bfloat16: all decode rows read block by block from the cache (replaces `decodes`).
    block_decode: BlockDecodePlan | None = None
    decode_tokens: torch.Tensor | None = None  # [B] token rows of the from-cache decode rows
    # ... with the C kernel instead of block_decode: [B] int64 block-table row and key count of each.
    decode_reqs: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_rows: cpu_decode.DecodeRows | None = None  # the same rows converted for the kernel, once per step
    slots_valid: bool | None = None  # CPU: no padding slot (-1) among the step's slots; None = not yet checked
    num_rows: int = 0  # token rows of the step's requests (query_start_loc[num_reqs]); rows past it are padding


class TorchSDPABackend:
    """Paged attention with torch ops; see the module docstring.

    Args:
        kv_tile_size: keys per tile for a prefill chunk (rounded down to whole
            blocks, at least one block). Smaller = less memory, more steps.
        decode_tile_budget: max keys gathered at once over a decode group
            (rows x keys); the per-row tile is this // rows.
        decode_group_keys: target size of a decode group in gathered keys
            (rows x the group's longest context, at least one row).
        use_sdpa_prefill: route prefill chunks to torch's fused SDPA (tests
            turn it off to exercise the paged path).
        decode_from_cache: on CPU in float32 or bfloat16, attend decodes straight from
            the cache (the C kernel, else `block_decode`) instead of gathering
            grouped copies of their K/V.
        use_cpu_kernel: let decode_from_cache use the C kernel when it builds
            (`cpu_decode.load_kernel`; also off with TOKENMILL_CPU_KERNELS=0).
    """

    name = "TORCH_SDPA"

    def __init__(
        self, kv_tile_size: int = 1024, decode_tile_budget: int = 64 * 1024, use_sdpa_prefill: bool = True,
        decode_group_keys: int = 4096, decode_from_cache: bool = True, use_cpu_kernel: bool = True,
    ) -> None:
        if kv_tile_size < 1:
            raise ValueError(f"kv_tile_size must be >= 1, got {kv_tile_size}.")
        self.kv_tile_size = kv_tile_size
        self.decode_tile_budget = decode_tile_budget
        self.decode_group_keys = decode_group_keys
        self.use_sdpa_prefill = use_sdpa_prefill
        self.decode_from_cache = decode_from_cache
        self.use_cpu_kernel = use_cpu_kernel
        self._plans: list[_Plan] = []  # plans per (metadata, window): this step's, maybe the last step's

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Write K/V to the cache, then attend. See `AttentionBackend.forward`.

        Shapes: query [T, H, D], key/value [T, Hkv, D], kv_cache [2, num_blocks,
        block_size, Hkv, D] (query's dtype, or fp8 with the layer's host-float
        `k_scale` / `v_scale`; a 16/32-bit cache ignores them); returns [T, H, D]
        in query's dtype. Rows past `num_actual_tokens` (padding) are left zero.
        """
        n = attn_metadata.num_actual_tokens
        fp8 = is_fp8(kv_cache.dtype)
        if not fp8:
            k_scale = v_scale = 1.0
        from_cache = (self.decode_from_cache and query.device.type == "cpu" and query.dtype in _BLOCK_DECODE_DTYPES
                      and (query.dtype == kv_cache.dtype or fp8))
        kernel = None
        # The C decode kernel has no sink term: sink layers decode with block_decode.
        if from_cache and self.use_cpu_kernel and sinks is None and cpu_decode.kernel_supports(query, kv_cache):
            kernel = cpu_decode.load_kernel()
        if fp8 and kernel is None:
            from_cache = False  # block_decode reads 16/32-bit caches only: gather and cast instead
        plan = self._get_plan(attn_metadata, sliding_window, kv_cache.shape[2], query.device, from_cache,
                              kernel is not None)
        slots = attn_metadata.slot_mapping
        if n != key.shape[0] or n != slots.shape[0]:  # padded rows (a whole decode batch has none: no slicing)
            key, value, slots = key[:n], value[:n], slots[:n]
        if plan.slots_valid is None and slots.device.type == "cpu":  # once per step, not per layer
            plan.slots_valid = slots.numel() == 0 or int(slots.min()) >= 0
        write_kv_cache(key, value, kv_cache, slots, k_scale, v_scale, all_valid=bool(plan.slots_valid),
                       use_cpu_kernel=self.use_cpu_kernel)
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        # Every token row of the step's requests is written below; only padding rows need zeros.
        out = torch.empty_like(query)
        if plan.num_rows < out.shape[0]:
            out[plan.num_rows :].zero_()
        if plan.decode_reqs is not None:
            assert kernel is not None and plan.decode_rows is not None
            cpu_decode.decode_rows_attention(kernel, query, kv_cache, plan.decode_rows, scale, out, sliding_window,
                                             logits_soft_cap, k_scale, v_scale)
        if plan.block_decode is not None:
            assert plan.decode_tokens is not None
            o = block_decode_attention(query, kv_cache, plan.block_decode, scale, logits_soft_cap, sinks)  # 16/32-bit
            out.index_copy_(0, plan.decode_tokens, o.to(out.dtype))
        for g in plan.decodes:
            assert g.tokens is not None and g.tiles is not None
            q5 = query.index_select(0, g.tokens).view(-1, num_kv_heads, group, 1, head_dim)
            o = _attend(q5, kv_cache, g.tiles, scale, logits_soft_cap, sinks, k_scale, v_scale)
            out.index_copy_(0, g.tokens, o.view(-1, num_heads, head_dim))
        for g in plan.prefills:
            q = query[g.start : g.end]
            if self.use_sdpa_prefill and logits_soft_cap is None and sinks is None:
                if g.fresh and not fp8:
                    out[g.start : g.end] = fresh_prefill_sdpa(q, key[g.start : g.end], value[g.start : g.end],
                                                               scale, sliding_window)
                    continue
                tiles = g.get_tiles()
                if len(tiles) == 1:
                    o = chunk_sdpa(q, kv_cache, tiles[0].block_ids, tiles[0].bias, scale * k_scale)
                    out[g.start : g.end] = o if v_scale == 1.0 else o * v_scale
                    continue
            qlen = g.end - g.start
            q5 = q.view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)[None]
            o = _attend(q5, kv_cache, g.get_tiles(), scale, logits_soft_cap, sinks, k_scale, v_scale)
            # [1, Hkv, G, Q, D] -> [Q, H, D]
            out[g.start : g.end] = o[0].permute(2, 0, 1, 3).reshape(qlen, num_heads, head_dim)
        return out

    # ---- planning (once per step and window) ---------------------------------------

    def _get_plan(self, md: AttentionMetadata, window: int | None, block_size: int, device: torch.device,
                  from_cache: bool, with_kernel: bool) -> _Plan:
        if self._plans and not any(p.md is md for p in self._plans) and len({id(p.md) for p in self._plans}) >= 2:
            # A new step. Plans of two metadata objects are kept: with two KV groups the sliding-window layers
            # have their own (attn_metadata_swa), and layers of the two groups alternate.
            self._plans = []
        for plan in self._plans:
            if plan.md is md and plan.window == window and plan.with_kernel == with_kernel:
                return plan
        plan = self._make_plan(md, window, block_size, device, from_cache, with_kernel)
        self._plans.append(plan)
        return plan

    def _make_plan(self, md: AttentionMetadata, window: int | None, block_size: int, device: torch.device,
                   from_cache: bool, with_kernel: bool) -> _Plan:
        qsl, seq_lens = md.query_start_loc_cpu.astype(np.int64), md.seq_lens_cpu.astype(np.int64)
        num_reqs = md.num_reqs
        query_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
        plan = _Plan(md, window, with_kernel, num_rows=int(qsl[num_reqs]))
        decodes = np.flatnonzero(query_lens == 1)
        if len(decodes) and from_cache and with_kernel:
            plan.decode_reqs = torch.from_numpy(decodes.astype(np.int64))
            plan.decode_tokens = torch.from_numpy(qsl[decodes])
            plan.decode_seq_lens = torch.from_numpy(seq_lens[decodes])
            plan.decode_rows = cpu_decode.decode_rows(md.block_table, plan.decode_reqs, plan.decode_tokens,
                                                      plan.decode_seq_lens)
        elif len(decodes) and from_cache:  # CPU: the block table is host memory, .numpy() is free
            plan.block_decode = plan_block_decode(md.block_table.numpy(), decodes, qsl[decodes], seq_lens[decodes],
                                                  block_size, window)
            plan.decode_tokens = torch.from_numpy(qsl[decodes])
        elif len(decodes):
            plan.decodes = self._plan_decodes(md, decodes, seq_lens[decodes], qsl[decodes], window, block_size,
                                              device)
        for i in np.flatnonzero(query_lens > 1).tolist():
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            qlen = end - start
            first_pos = seq_len - qlen
            # With a window, blocks wholly before the first query's window are skipped.
            start_block = max(0, first_pos - window + 1) // block_size if window else 0
            block_idx = np.arange(start_block, -(-seq_len // block_size))[None]  # [1, nb]
            qpos = np.arange(first_pos, seq_len)[None]  # [1, Q]
            tile_blocks = max(1, self.kv_tile_size // block_size)
            args = (md.block_table[i : i + 1], block_idx, qpos, window, block_size, tile_blocks, device)
            plan.prefills.append(_Group(None, args, start=start, end=end, fresh=first_pos == 0))
        return plan

    def _plan_decodes(self, md, reqs, seq_lens, tokens, window, block_size, device) -> list[_Group]:
        """Decode rows sorted by length, cut into groups of about `decode_group_keys` padded keys.

        seq_lens [300, 20, 310, 25], 64 keys per group -> order [1, 3, 0, 2]; padded
        to 32 keys, rows 1 and 3 fit one group; rows 0 and 2 (304 and 320 keys) get one each.
        """
        # Per row, the blocks that can hold visible keys:
        #   seq_lens [5, 40], block 16, window 8 -> first [0, 2], last [0, 2] (blocks of pos 32..39)
        first = np.maximum(0, seq_lens - window) // block_size if window else np.zeros_like(seq_lens)
        nblocks = -(-seq_lens // block_size) - first
        order = np.argsort(nblocks, kind="stable")
        groups = []
        start = 0
        while start < len(order):
            # Sorted ascending, so a group's last row has its longest context.
            end = start + 1
            while end < len(order) and (end + 1 - start) * nblocks[order[end]] * block_size <= self.decode_group_keys:
                end += 1
            sel = order[start:end]
            start = end
            nb = int(nblocks[sel].max())
            # block_idx[b, t] = first[b] + t; entries past a row's end are masked by position.
            block_idx = first[sel][:, None] + np.arange(nb)[None]
            rows = md.block_table[torch.from_numpy(reqs[sel]).to(device, non_blocking=True)]
            tile_blocks = max(1, self.decode_tile_budget // (len(sel) * block_size))
            tiles = _plan_tiles(rows, block_idx, (seq_lens[sel] - 1)[:, None], window, block_size, tile_blocks,
                                device)
            groups.append(_Group(tiles, tokens=torch.from_numpy(tokens[sel]).to(device, non_blocking=True)))
        return groups


def _plan_tiles(
    block_rows: torch.Tensor,  # [B, max_blocks_per_req] int32 block ids (device)
    block_idx: np.ndarray,  # [B, nb] logical block indices to visit (may run past a row's end)
    qpos: np.ndarray,  # [B, Q] absolute query positions
    window: int | None,
    block_size: int,
    tile_blocks: int,
    device: torch.device,
) -> list[_Tile]:
    """Split each row's blocks into tiles of `tile_blocks` and precompute their masks.

    Key position of (b, t, o) = block_idx[b, t] * block_size + o; visible to
    query position p iff key_pos <= p (which also keeps it < seq_len) and,
    with a window W, key_pos > p - W.
    """
    bsz, nb = block_idx.shape
    width = block_rows.shape[1]
    idx_all = torch.from_numpy(block_idx).to(device, non_blocking=True)
    qpos_t = torch.from_numpy(qpos).to(device, non_blocking=True)
    offsets = torch.arange(block_size, device=device)
    tiles = []
    q_min, q_max = int(qpos.min()), int(qpos.max())
    for t0 in range(0, nb, tile_blocks):
        idx = idx_all[:, t0 : t0 + tile_blocks]  # [B, nbt]
        ntok = idx.shape[1] * block_size
        # Logical index past the table's width only occurs for masked keys; clamp to stay in bounds.
        ids = torch.gather(block_rows, 1, idx.clamp(max=width - 1)).flatten().long()
        # Host-side check (NumPy, no sync): the tile's keys span [k_min, k_max].
        k_min = int(block_idx[:, t0 : t0 + tile_blocks].min()) * block_size
        k_max = (int(block_idx[:, t0 : t0 + tile_blocks].max()) + 1) * block_size - 1
        if k_max <= q_min and (window is None or k_min > q_max - window):
            tiles.append(_Tile(ids, None))
            continue
        kpos = (idx[:, :, None] * block_size + offsets).reshape(bsz, ntok)  # [B, T]
        visible = kpos[:, None, :] <= qpos_t[:, :, None]  # [B, Q, T]
        if window is not None:
            visible &= kpos[:, None, :] > qpos_t[:, :, None] - window
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=device).masked_fill_(~visible, float("-inf"))
        tiles.append(_Tile(ids, bias[:, None, None]))
    return tiles


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0, all_valid: bool = False,
                   use_cpu_kernel: bool = False) -> None:
    """Store each token's K/V at its slot; slot -1 (padding) is skipped.

    key/value: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64 (slot = block_id * block_size + offset). An fp8
    cache stores key / k_scale and value / v_scale (`kernels.kv_fp8.quantize_kv`).
    all_valid: the caller checked that no slot is -1 (the CPU path then skips its own check).
    use_cpu_kernel: a 16/32-bit CPU cache in the tokens' dtype is written by one C call
    (`kernels.cpu.elementwise.write_kv_cache`, the same bytes) where the kernels build.
    """
    if slot_mapping.numel() == 0:
        return
    if slot_mapping.device.type == "cpu":
        if (use_cpu_kernel and cpu_elementwise.kv_write_supports(key, value, kv_cache, slot_mapping)
                and (lib := cpu_elementwise.load()) is not None):
            cpu_elementwise.write_kv_cache(lib, key, value, kv_cache, slot_mapping)  # skips -1 slots itself
            return
        if not all_valid and int(slot_mapping.min()) < 0:
            valid = slot_mapping >= 0
            slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    else:
        slot_mapping, key, value = _redirect_padding(slot_mapping, key, value)
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    store_kv(key, flat[0], slot_mapping, k_scale)
    store_kv(value, flat[1], slot_mapping, v_scale)


def _redirect_padding(
    slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Skip -1 slots without a host sync: padding rows become copies of the first valid row.

    A duplicate index with an identical value writes the same bytes, so the
    copy stays deterministic: slots [-1, 7, -1, 9] -> [7, 7, 7, 9] (rows 0, 2 take row 1's K/V).
    Needs at least one valid slot (the caller passes only the step's real tokens).
    """
    valid = slot_mapping >= 0
    first = valid.to(torch.int8).argmax()  # index of the first valid row, on the device
    slot_mapping = torch.where(valid, slot_mapping, slot_mapping[first])
    keep = valid[:, None, None]
    return slot_mapping, torch.where(keep, key, key[first]), torch.where(keep, value, value[first])


def _tile_scores(q_flat, kv_cache, tile, scale, cap):
    """Gather one tile's K/V and return (scores [B, Hkv, G*Q, T] float32 incl. bias, v [B, T, Hkv, D]).

    index_select keeps the cache layout: [B*nbt, bs, Hkv, D] -> [B, T, Hkv, D]. Slicing one KV
    head gives a strided [B, T, D] that bmm takes without a copy (a 4-D matmul over [B, Hkv]
    would first copy K into [B, Hkv, T, D]).
    """
    bsz, num_kv_heads, rows, head_dim = q_flat.shape
    k = gather_blocks(kv_cache[0], tile.block_ids).view(bsz, -1, num_kv_heads, head_dim)
    v = gather_blocks(kv_cache[1], tile.block_ids).view(bsz, -1, num_kv_heads, head_dim)
    if k.dtype != q_flat.dtype:
        k, v = k.to(q_flat.dtype), v.to(q_flat.dtype)
    s = torch.stack([torch.bmm(q_flat[:, h], k[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)], dim=1)
    if s.dtype != torch.float32:
        s = s.float()
    # In place: s is this function's own tensor, and each copy would be another [R, tile].
    if cap is not None:
        s = s.mul_(scale / cap).tanh_().mul_(cap)
    else:
        s = s.mul_(scale)
    if tile.bias is not None:
        ntok = s.shape[-1]
        qlen = tile.bias.shape[3]
        s = (s.view(bsz, num_kv_heads, rows // qlen, qlen, ntok) + tile.bias).view(bsz, num_kv_heads, rows, ntok)
    return s, v


def _pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [B, Hkv, R, T] float32 @ v [B, T, Hkv, D] per KV head -> [B, Hkv, R, D] float32."""
    p = p.to(v.dtype)
    out = torch.stack([torch.bmm(p[:, h], v[:, :, h]) for h in range(v.shape[2])], dim=1)
    return out if out.dtype == torch.float32 else out.float()


def _attend(
    q: torch.Tensor,  # [B, Hkv, G, Q, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    tiles: list[_Tile],
    scale: float,
    cap: float | None,
    sinks: torch.Tensor | None = None,  # [H] float, H = Hkv * G
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, Hkv, G, Q, D] in q's dtype
    """Attention of B query groups over their planned key tiles.

    One tile: plain softmax. Several: online softmax over tiles, so the
    largest score tensor is [B, Hkv, G, Q, tile keys]. With `sinks`, head h's
    denominator gains exp(sinks[h]) (relative to the running max, which the
    sink joins), after the last tile. An fp8 cache's k_scale joins the score
    scale and v_scale multiplies the float32 result (1.0 for other caches).
    """
    bsz, num_kv_heads, group, qlen, head_dim = q.shape
    q_flat = q.reshape(bsz, num_kv_heads, group * qlen, head_dim)
    scale = scale * k_scale
    if len(tiles) == 1 and sinks is None:
        s, v = _tile_scores(q_flat, kv_cache, tiles[0], scale, cap)
        o = _pv(s.softmax(dim=-1), v)
        return (o if v_scale == 1.0 else o * v_scale).view(q.shape).to(q.dtype)
    m = l = acc = None
    for tile in tiles:
        s, v = _tile_scores(q_flat, kv_cache, tile, scale, cap)
        tile_max = s.amax(dim=-1)  # [B, Hkv, R]
        m_new = tile_max if m is None else torch.maximum(m, tile_max)
        # A row with nothing visible yet keeps max -inf; subtract 0 instead so exp gives 0, not NaN.
        m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)
        p = s.sub_(m_safe[..., None]).exp_()  # in place: one [B, Hkv, R, tile] tensor per tile
        pv = _pv(p, v)
        if m is None:
            l, acc = p.sum(dim=-1), pv
        else:
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(dim=-1)
            acc = acc * corr[..., None] + pv
        m = m_new
        del s, p, v  # free this tile's scores before the next tile's are built
    assert acc is not None and l is not None and m is not None, "every request has at least one key"
    if sinks is not None:
        # Row r of a KV head's [G * Q] rows is query head g = r // Q: sinks [Hkv * G] -> [1, Hkv, G * Q].
        sink = sinks.float().view(num_kv_heads, group).repeat_interleave(qlen, dim=1)[None]
        m_fin = torch.maximum(m, sink)
        corr = torch.exp(m - m_fin)
        l = l * corr + torch.exp(sink - m_fin)
        acc = acc * corr[..., None]
    o = acc / l[..., None]
    return (o if v_scale == 1.0 else o * v_scale).view(q.shape).to(q.dtype)
