"""Steps under CUDA graphs: capture the model's forward at padded sizes, replay.

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
from the batch (the flash-decoding split count) are fixed at capture; any
split count is correct for any context length. Decode graphs are captured
for sequences up to min(max_model_len, LONG_DECODE_SEQ) and, for the small
batch sizes whose split count differs past it (`choose_num_splits`: up to
64 splits instead of 16), a second time for max_model_len; a step whose
longest sequence is longer than LONG_DECODE_SEQ replays the second.
Mixed steps (prefill chunks, alone or beside decodes; TOKENMILL_MIXED_CUDA_GRAPHS,
default on) of `t <= MIXED_MAX_TOKENS` tokens replay the graph captured for
the smallest mixed size `S >= t` (`mixed_capture_sizes`). An eager forward
costs the host about a millisecond a layer (module calls, kernel launches,
cuBLAS's per-call setup: H200, Llama-3.1-8B, a 1024-token prefill took
36.9 ms to its first token for 21.7 ms of GPU work), so below a few thousand
tokens the GPU waits on the host. A mixed graph is captured with
`num_reqs` = R, a bound on its requests, which is all the attention kernel
takes from the host besides the token count, so one graph
serves any mix: `pad_mixed_inputs` makes requests [n, R) empty (query
length 0, seq_len 0: each owns one idle query block) and tokens [t, S) the
kernel's virtual padding request (zero output, slot -1, nothing read or
written in the KV cache). R is min(max_num_seqs, S) (a step of S tokens has
at most S requests), so the idle programs, which only find their request
and exit, stay few. Above MIXED_MAX_TOKENS the GPU time exceeds the host's and
padding would only add work, so those steps stay eager.

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
# Mixed steps of more tokens than this run eagerly (module docstring).
MIXED_MAX_TOKENS = 2048
# Mixed-step capture sizes (tokens): a padded step computes under 1.5x the tokens it has above 64 (65 -> 96,
# 129 -> 192) and at most 1.25x above 256 (tests/worker/test_cuda_graph.py::test_mixed_capture_sizes).
_MIXED_SIZES = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


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


def mixed_capture_sizes(max_num_batched_tokens: int, enabled: bool = True) -> list[int]:
    """Token counts of the mixed-step graphs, ascending: `_MIXED_SIZES` up to cap = min(max_num_batched_tokens,
    MIXED_MAX_TOKENS), plus cap itself; [] when not `enabled` (TOKENMILL_MIXED_CUDA_GRAPHS off).
    max_num_batched_tokens 300 -> [16, 32, 64, 96, 128, 192, 256, 300]."""
    if not enabled:
        return []
    cap = min(max_num_batched_tokens, MIXED_MAX_TOKENS)
    sizes = [s for s in _MIXED_SIZES if s <= cap]
    if cap >= 1 and (not sizes or sizes[-1] != cap):
        sizes.append(cap)
    return sizes


def padded_size(sizes: list[int], n: int) -> int | None:
    """Smallest capture size >= n (sizes ascending), or None when n is above all of them."""
    for s in sizes:
        if s >= n:
            return s
    return None


class CUDAGraphRunner:
    """Captured decode and mixed-step graphs over the runner's persistent buffers.

    Args:
        forward: the model forward, `forward(input_ids [B] int64, positions [B] int64) -> hidden [B, H]`.
        buffers: the persistent device buffers (views are taken from offset 0):
            "input_ids", "positions", "slot_mapping" ([>= B] int64),
            "query_start_loc" ([>= B + 1] int32), "seq_lens" ([>= B] int32).
        block_table: the persistent device block table [max_num_reqs, max_blocks] int32.
        kv_caches, attn_backend: what the forward context hands the attention layers.
        sizes: decode capture sizes, ascending (see `capture_sizes`).
        max_model_len: the longest sequence a graph replays (the runner's graph_max_seq_len); the decode graphs'
            split counts are fixed at capture for min(it, LONG_DECODE_SEQ), and for it in the long graphs.
        block_table_swa: with a sliding-window KV group, its persistent device block table (and
            buffers["slot_mapping_swa"] its slots); None with one group.
        mixed_sizes: token counts of the mixed-step graphs, ascending (`mixed_capture_sizes`; [] = none).
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
        mixed_sizes: list[int] | None = None,
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
        # Decode graphs for steps with a sequence past LONG_DECODE_SEQ (more KV splits; module docstring).
        self.long_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        from tokenmill.kernels.triton import attention_config  # Triton: CUDA runs only (kernels/__init__.py)

        self._splits = attention_config.choose_num_splits
        self.long_seq = attention_config.LONG_DECODE_SEQ
        self.long_outputs: dict[int, torch.Tensor] = {}
        self.mixed_sizes = list(mixed_sizes or [])
        self.max_reqs = block_table.shape[0]  # block-table rows (max_num_seqs)
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # decode replays, long ones included
        self.num_long_replays = 0  # decode replays of a long graph (`replay`)
        self.num_mixed_replays = 0
        device = buffers["input_ids"].device
        # 1..max_size+1 as int32, to write padding requests' query_start_loc without a host copy.
        self._arange = torch.arange(sizes[-1] + 2, dtype=torch.int32, device=device)

    def metadata(self, size: int, long: bool = False) -> AttentionMetadata:
        """The attention metadata a graph of `size` decodes is captured with (views of the buffers); its
        max_seq_len, which sets the kernel's split count, is min(max_model_len, LONG_DECODE_SEQ), or
        max_model_len for a `long` graph."""
        return AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=size,
            max_query_len=1,
            max_seq_len=self.max_model_len if long else min(self.max_model_len, self.long_seq),
            query_start_loc=self.buf["query_start_loc"][: size + 1],
            seq_lens=self.buf["seq_lens"][:size],
            block_table=self.block_table[:size],
            slot_mapping=self.buf["slot_mapping"][:size],
            query_start_loc_cpu=None,  # type: ignore[arg-type]  # only host-looping backends read these
            seq_lens_cpu=None,  # type: ignore[arg-type]
        )

    def metadata_swa(self, md: AttentionMetadata) -> AttentionMetadata | None:
        """The sliding-window group's copy of a graph's metadata `md` (its block table and slots; the same
        requests and tokens), or None with one group."""
        if self.block_table_swa is None:
            return None
        return replace(md, block_table=self.block_table_swa[: md.num_reqs],
                       slot_mapping=self.buf["slot_mapping_swa"][: md.num_actual_tokens])

    def long_sizes(self) -> list[int]:
        """The decode sizes that also get a graph for sequences past LONG_DECODE_SEQ: those whose split count
        (for the first KV cache's kv heads) differs there; none when max_model_len <= LONG_DECODE_SEQ."""
        if self.max_model_len <= self.long_seq or not self.kv_caches:
            return []
        device, kv_heads = self.buf["input_ids"].device, self.kv_caches[0].shape[-2]
        return [s for s in self.sizes if self._splits(device, 1, s, kv_heads, self.max_model_len)
                != self._splits(device, 1, s, kv_heads, self.long_seq)]

    def mixed_reqs(self, size: int) -> int:
        """R of the mixed graph of `size` tokens: the requests it is captured for (a step has at most one per
        token, and at most the block table's rows)."""
        return min(self.max_reqs, size)

    def metadata_mixed(self, size: int) -> AttentionMetadata:
        """The metadata a mixed graph of `size` tokens is captured with: R requests (module docstring),
        max_query_len = size (> 4: the kernel's prefill tiles, no KV splits)."""
        r = self.mixed_reqs(size)
        return replace(self.metadata(size), num_reqs=r, max_query_len=max(size, 5),
                       query_start_loc=self.buf["query_start_loc"][: r + 1], seq_lens=self.buf["seq_lens"][:r],
                       block_table=self.block_table[:r])

    def pad_mixed_inputs(self, num_reqs: int, num_tokens: int, size: int) -> None:
        """For the mixed graph of `size` tokens, make requests [num_reqs, R) empty (query_start_loc num_tokens,
        seq_len 0) and tokens [num_tokens, size) padding (id 0, position 0, slot -1): the kernel's virtual padding
        request.

        Device-side writes on the current stream after the step's own copies; no host sync.
        """
        r = self.mixed_reqs(size)
        self.buf["query_start_loc"][num_reqs + 1 : r + 1].fill_(num_tokens)
        self.buf["seq_lens"][num_reqs:r].zero_()
        if size > num_tokens:
            self.buf["slot_mapping"][num_tokens:size].fill_(-1)
            if self.block_table_swa is not None:
                self.buf["slot_mapping_swa"][num_tokens:size].fill_(-1)
            self.buf["input_ids"][num_tokens:size].zero_()
            self.buf["positions"][num_tokens:size].zero_()

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

    def _capture_one(self, size: int, md: AttentionMetadata, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run the forward of `size` tokens under `md` once eagerly (Triton compiles, cuBLAS picks its kernels),
        then capture it into `pool`; the buffers must already describe padding only."""
        ids, pos = self.buf["input_ids"][:size], self.buf["positions"][:size]
        with set_forward_context(md, self.kv_caches, self.attn_backend, self.metadata_swa(md)):
            self.forward(ids, pos)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(ids, pos)
        return graph, out

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size (the mixed sizes, then the decode sizes, each largest first), sharing
        one memory pool. Every row is padding while capturing, so nothing is written to the KV cache."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        self.buf["query_start_loc"][:1].zero_()
        for size in reversed(self.mixed_sizes):
            self.pad_mixed_inputs(0, 0, size)
            self.mixed_graphs[size], self.mixed_outputs[size] = self._capture_one(size, self.metadata_mixed(size),
                                                                                  pool)
        for size in reversed(self.sizes):
            self.pad_decode_inputs(0, size)
            self.graphs[size], self.outputs[size] = self._capture_one(size, self.metadata(size), pool)
        long_sizes = self.long_sizes()
        for size in reversed(long_sizes):
            self.pad_decode_inputs(0, size)
            self.long_graphs[size], self.long_outputs[size] = self._capture_one(size, self.metadata(size, True), pool)
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        mixed = (f" and {len(self.mixed_sizes)} for mixed steps of {self.mixed_sizes[0]}..{self.mixed_sizes[-1]} "
                 "tokens" if self.mixed_sizes else "")
        long = (f" (and {len(long_sizes)} of {long_sizes[0]}..{long_sizes[-1]} requests for sequences past "
                f"{self.long_seq} tokens)" if long_sizes else "")
        logger.info("Captured %d CUDA graphs for decode batches of %d..%d requests%s%s in %.1f s (%.2f GiB)",
                    len(self.sizes), self.sizes[0], self.sizes[-1], long, mixed, time.perf_counter() - start,
                    used / 2**30)

    def release(self) -> None:
        """Drop the graphs (their memory pool), outputs and references to the model and KV cache."""
        self.graphs.clear()
        self.outputs.clear()
        self.long_graphs.clear()
        self.long_outputs.clear()
        self.mixed_graphs.clear()
        self.mixed_outputs.clear()
        self.kv_caches = []
        self.forward = None  # type: ignore[assignment]

    def replay(self, num_reqs: int, max_seq_len: int = 0) -> torch.Tensor | None:
        """Run the decode step of `num_reqs` requests (rows [0, num_reqs) already in the buffers) whose longest
        sequence is `max_seq_len` tokens (past LONG_DECODE_SEQ: the long graph of the size, if there is one).

        Returns hidden states [num_reqs, H] (a view of the graph's output,
        valid until the next replay), or None when no captured size fits.
        """
        size = padded_size(self.sizes, num_reqs)
        if size is None or size not in self.graphs:
            return None
        graphs, outputs = self.graphs, self.outputs
        long = max_seq_len > self.long_seq and size in self.long_graphs
        if long:
            graphs, outputs = self.long_graphs, self.long_outputs
        self.pad_decode_inputs(num_reqs, size)
        graphs[size].replay()
        self.num_replays += 1
        self.num_long_replays += int(long)
        return outputs[size][:num_reqs]

    def replay_mixed(self, num_reqs: int, num_tokens: int) -> torch.Tensor | None:
        """Run a step of `num_tokens` tokens from `num_reqs` requests, some of them prefill chunks (their rows
        already in the buffers: query_start_loc [0, num_reqs], seq_lens, block table rows, tokens).

        Returns hidden states [num_tokens, H] (a view of the graph's output, valid until the next replay), or
        None when no mixed size fits (then the step runs eagerly).
        """
        size = padded_size(self.mixed_sizes, num_tokens)
        if size is None or size not in self.mixed_graphs or num_reqs > self.mixed_reqs(size):
            return None
        self.pad_mixed_inputs(num_reqs, num_tokens, size)
        self.mixed_graphs[size].replay()
        self.num_mixed_replays += 1
        return self.mixed_outputs[size][:num_tokens]
