"""Decode steps under CUDA graphs: capture the model's forward at padded batch sizes, replay.

A decode-only step (every scheduled request adds one token) of `n` requests
runs the graph captured for the smallest capture size `B >= n`. The graph
reads the runner's persistent device buffers (input ids, positions and the
attention metadata tensors of `InputBatch`), so a replay only needs those
buffers filled: `prepare_inputs` writes rows `[0, n)` as for an eager step,
and `pad_decode_inputs` turns rows `[n, B)` into harmless padding requests
(one token each, `slot_mapping` -1 so nothing is written to the KV cache,
`seq_lens` 1 so each reads one slot of whatever block its stale block-table
row names). Their hidden states are computed and dropped.

Capture sizes follow the issue: 1, 2, 4, 8, then steps of 16 up to
min(max_num_seqs, max_num_batched_tokens, 512), plus that cap itself.

Launch parameters that the Triton attention kernel would otherwise take
from the batch (the flash-decoding split count) are fixed at capture for
`max_model_len`; any split count is correct for any context length.
Only the TRITON_ATTN backend on CUDA, one pipeline stage, can be captured
(TORCH_SDPA loops over requests on the host).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from tokenmill.attention.forward_context import set_forward_context
from tokenmill.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Padded decode batch sizes to capture, ascending.

    1, 2, 4, 8, then multiples of 16, up to cap = min(max_num_seqs,
    max_num_batched_tokens, 512); cap itself is included so every decode
    batch up to it has a graph. max_num_seqs 40 -> [1, 2, 4, 8, 16, 32, 40].
    """
    cap = min(max_num_seqs, max_num_batched_tokens, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s <= cap] + list(range(16, cap + 1, 16))
    if cap >= 1 and sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_size(sizes: list[int], n: int) -> int | None:
    """Smallest capture size >= n (sizes ascending), or None when n is above all of them."""
    for s in sizes:
        if s >= n:
            return s
    return None


class CUDAGraphRunner:
    """Captured decode graphs over the runner's persistent buffers.

    Args:
        forward: the model forward, `forward(input_ids [B] int64, positions [B] int64) -> hidden [B, H]`.
        buffers: the persistent device buffers (views are taken from offset 0):
            "input_ids", "positions", "slot_mapping" ([>= B] int64),
            "query_start_loc" ([>= B + 1] int32), "seq_lens" ([>= B] int32).
        block_table: the persistent device block table [max_num_reqs, max_blocks] int32.
        kv_caches, attn_backend: what the forward context hands the attention layers.
        sizes: capture sizes, ascending (see `capture_sizes`).
        max_model_len: longest sequence (fixes the kernel's split count at capture).
        block_table_swa: with a sliding-window KV group, its persistent device block table (and
            buffers["slot_mapping_swa"] its slots); None with one group.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        buffers: dict[str, torch.Tensor],
        block_table: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_backend,
        sizes: list[int],
        max_model_len: int,
        block_table_swa: torch.Tensor | None = None,
    ) -> None:
        self.forward = forward
        self.buf = buffers
        self.block_table = block_table
        self.block_table_swa = block_table_swa
        self.kv_caches = kv_caches
        self.attn_backend = attn_backend
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        device = buffers["input_ids"].device
        # 1..max_size+1 as int32, to write padding requests' query_start_loc without a host copy.
        self._arange = torch.arange(sizes[-1] + 2, dtype=torch.int32, device=device)

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata a graph of `size` decodes is captured with (views of the buffers)."""
        return AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self.buf["query_start_loc"][: size + 1],
            seq_lens=self.buf["seq_lens"][:size],
            block_table=self.block_table[:size],
            slot_mapping=self.buf["slot_mapping"][:size],
            query_start_loc_cpu=None,  # type: ignore[arg-type]  # only host-looping backends read these
            seq_lens_cpu=None,  # type: ignore[arg-type]
        )

    def metadata_swa(self, size: int) -> AttentionMetadata | None:
        """The sliding-window group's metadata of a graph of `size` decodes (None with one group)."""
        if self.block_table_swa is None:
            return None
        return replace(self.metadata(size), block_table=self.block_table_swa[:size],
                       slot_mapping=self.buf["slot_mapping_swa"][:size])

    def pad_decode_inputs(self, num_reqs: int, size: int) -> None:
        """Make rows [num_reqs, size) padding requests: one token each, seq_len 1, slot -1.

        Device-side writes on the current stream, ordered after the step's
        host-to-device copies of rows [0, num_reqs); no host sync.
        """
        if size == num_reqs:
            return
        self.buf["slot_mapping"][num_reqs:size].fill_(-1)
        if self.block_table_swa is not None:
            self.buf["slot_mapping_swa"][num_reqs:size].fill_(-1)
        self.buf["seq_lens"][num_reqs:size].fill_(1)
        self.buf["query_start_loc"][num_reqs + 1 : size + 1].copy_(self._arange[num_reqs + 1 : size + 1])
        self.buf["input_ids"][num_reqs:size].zero_()
        self.buf["positions"][num_reqs:size].zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, sharing one memory pool.

        Each size is run once eagerly first (Triton compiles, cuBLAS picks
        its kernels) with every row a padding request, so nothing is written
        to the KV cache.
        """
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        self.buf["query_start_loc"][:1].zero_()
        for size in reversed(self.sizes):
            self.pad_decode_inputs(0, size)
            md = self.metadata(size)
            ids, pos = self.buf["input_ids"][:size], self.buf["positions"][:size]
            with set_forward_context(md, self.kv_caches, self.attn_backend, self.metadata_swa(size)):
                self.forward(ids, pos)  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(ids, pos)
            self.graphs[size] = graph
            self.outputs[size] = out
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("Captured %d CUDA graphs for decode batches of %d..%d requests in %.1f s (%.2f GiB)",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start, used / 2**30)

    def release(self) -> None:
        """Drop the graphs (their memory pool), outputs and references to the model and KV cache."""
        self.graphs.clear()
        self.outputs.clear()
        self.kv_caches = []
        self.forward = None  # type: ignore[assignment]

    def replay(self, num_reqs: int) -> torch.Tensor | None:
        """Run the decode step of `num_reqs` requests (rows [0, num_reqs) already in the buffers).

        Returns hidden states [num_reqs, H] (a view of the graph's output,
        valid until the next replay), or None when no captured size fits.
        """
        size = padded_size(self.sizes, num_reqs)
        if size is None or size not in self.graphs:
            return None
        self.pad_decode_inputs(num_reqs, size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:num_reqs]
