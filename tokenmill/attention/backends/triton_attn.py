"""TRITON_ATTN: paged attention with the Triton kernels (CUDA cc >= 7.0, ROCm).

`forward` launches its kernels on the current stream and nothing else: the
KV write (`kernels.reshape_and_cache`) then the varlen paged attention
(`kernels.paged_attention`: one launch, or two in a step with prefill tokens,
the decodes with their own tiles; plus a split-merge kernel for small decode
batches). Grid sizes come from host ints already in the
metadata (num_reqs, max_query_len) and tensor shapes, never from `.item()`,
and the only allocation is the output (shape fixed by num_tokens), so decode
steps can be captured in CUDA graphs at padded batch sizes.
"""

from __future__ import annotations

import torch

from tokenmill import kernels
from tokenmill.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    """Implements tokenmill.attention.backends.base.AttentionBackend.

    Args:
        num_stages: Triton pipelining depth; default from the device
            (1 on compute capability 7.x or under TOKENMILL_FORCE_CC70, else 2;
            1 on CPU, where the kernels only run under TRITON_INTERPRET=1).
        force_cc70: plan for a compute-capability-7.0 device.
    """

    name = "TRITON_ATTN"

    def __init__(self, num_stages: int | None = None, force_cc70: bool = False) -> None:
        if num_stages is None:
            num_stages = 1
            if torch.cuda.is_available():
                from tokenmill.platforms.cuda import (
                    effective_capability,
                    force_cc70_requested,
                    triton_launch_settings,
                )

                cap = effective_capability(torch.cuda.get_device_capability(), force_cc70_requested(force_cc70))
                num_stages = triton_launch_settings(cap)["num_stages"]
        self.num_stages = num_stages

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] gpt-oss sink logits
        k_scale: float = 1.0,  # fp8 KV cache: the layer's scales (stored k / k_scale, read q8 * k_scale)
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the step's K/V into `kv_cache`, then attend (see the base class).

        Tokens past `query_start_loc[num_reqs]` (graph padding, slot -1) get
        zero output rows and write nothing to the cache.
        """
        md = attn_metadata
        kernels.reshape_and_cache(key, value, kv_cache, md.slot_mapping, k_scale, v_scale)
        return kernels.paged_attention(
            query,
            kv_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            num_reqs=md.num_reqs,
            max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            sinks=sinks,
            num_stages=self.num_stages,
            k_scale=k_scale,
            v_scale=v_scale,
        )
