"""A test-only attention backend and a helper to run a tokenmill model on one prompt.

The backend is dense causal attention over the new tokens of each request,
with GQA by repeating kv heads; it reads no cache and writes none, so it is
only right for requests whose whole sequence is in the step (no cached
context). It keeps model tests independent of the paged backends.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.attention.forward_context import set_forward_context
from tokenmill.attention.metadata import AttentionMetadata


class DenseCausalBackend:
    name = "TEST_DENSE"

    def forward(self, query, key, value, kv_cache, attn_metadata, *, scale, sliding_window=None,
                logits_soft_cap=None, sinks=None, k_scale=1.0, v_scale=1.0):
        out = torch.empty_like(query)
        starts = attn_metadata.query_start_loc_cpu
        group = query.shape[1] // key.shape[1]
        for i in range(attn_metadata.num_reqs):
            s, e = int(starts[i]), int(starts[i + 1])
            q = query[s:e].transpose(0, 1).float()  # [H, n, D]
            k = key[s:e].repeat_interleave(group, dim=1).transpose(0, 1).float()
            v = value[s:e].repeat_interleave(group, dim=1).transpose(0, 1).float()
            scores = q @ k.transpose(1, 2) * scale  # [H, n, n]
            if logits_soft_cap is not None:
                scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            n = e - s
            pos = torch.arange(n, device=query.device)
            mask = pos[None, :] <= pos[:, None]
            if sliding_window is not None:
                mask &= pos[:, None] - pos[None, :] < sliding_window
            scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is not None:  # one extra logit per head in the denominator, no value
                sink_col = sinks.float()[:, None, None].expand(-1, n, 1)
                probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            out[s:e] = (probs @ v).transpose(0, 1).to(query.dtype)
        return out


def single_prompt_metadata(num_tokens: int, device: str = "cpu") -> AttentionMetadata:
    """Metadata for one request of `num_tokens` new tokens and no cached context."""
    qsl = np.array([0, num_tokens], dtype=np.int32)
    seq_lens = np.array([num_tokens], dtype=np.int32)
    return AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens, max_seq_len=num_tokens,
        query_start_loc=torch.from_numpy(qsl).to(device), seq_lens=torch.from_numpy(seq_lens).to(device),
        block_table=torch.zeros(1, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )


@torch.no_grad()
def run_prompt(model, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of a tokenmill model on one prompt (positions 0..n-1)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    positions = torch.arange(len(token_ids), dtype=torch.int64, device=device)
    num_layers = model.config.num_hidden_layers
    kv_caches = [torch.empty(0, device=device) for _ in range(num_layers)]
    with set_forward_context(single_prompt_metadata(len(token_ids), str(device)), kv_caches, DenseCausalBackend()):
        hidden = model(input_ids, positions)
    return model.compute_logits(hidden)


@pytest.fixture
def run_tokenmill_prompt():
    """The `run_prompt(model, token_ids) -> logits [n, vocab] float32` helper."""
    return run_prompt


@pytest.fixture(scope="session")
def gemma3_llm(gemma3_gguf):
    """tokenmill's `LLM` on the Gemma 3 270M GGUF (float32, max_model_len 256, 64 KV blocks, its linear weights
    kept quantized: TOKENMILL_CPU_GGUF_KERNELS=1), loaded once (~20-40 s on 2 cores) for test_gemma3_gguf.py
    and test_gguf_quantized.py (one worker: both name `gemma3_gguf`, tests/conftest.py)."""
    from tokenmill import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_CPU_GGUF_KERNELS", "1")
        llm = LLM(model=gemma3_gguf, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, seed=0)
    yield llm
    llm.llm_engine.shutdown()
