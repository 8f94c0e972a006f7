"""Helpers for model-family parity tests: paged batch prefill through TORCH_SDPA, HF greedy references.

`batch_prefill_logits` runs a tokenmill model on several prompts in ONE
forward pass (a mixed-length prefill batch) over a real paged KV cache with
the TORCH_SDPA backend's tiled path, blocks handed out in shuffled order.
`hf_greedy` decodes with transformers step by step (its own KV cache)
and keeps each step's logits, so a divergence can be judged by the
near-tie rule (`compare_greedy`).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.forward_context import set_forward_context
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.layers.attention import Attention


def _kv_caches(model, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    layers = sorted((m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)
    dtype = next(model.parameters()).dtype
    return [torch.zeros(2, num_blocks, block_size, m.num_kv_heads, m.head_dim, dtype=dtype) for m in layers]


@torch.no_grad()
def batch_prefill_logits(model, prompts: list[list[int]], block_size: int = 4, kv_tile_size: int = 8,
                         seed: int = 0) -> list[torch.Tensor]:
    """float32 logits [len(p), vocab] of each prompt, all prompts prefilled in one step."""
    lens = [len(p) for p in prompts]
    blocks_per = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    block_table = torch.zeros(len(prompts), max(blocks_per), dtype=torch.int32)
    slots, start = [], 0
    for i, (n, nb) in enumerate(zip(lens, blocks_per)):
        block_table[i, :nb] = torch.tensor(perm[start:start + nb], dtype=torch.int32)
        start += nb
        pos = torch.arange(n)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq_lens = np.array(lens, dtype=np.int32)
    md = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(prompts), max_query_len=max(lens), max_seq_len=max(lens),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens), block_table=block_table,
        slot_mapping=torch.cat(slots), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    positions = torch.cat([torch.arange(n) for n in lens])
    backend = TorchSDPABackend(kv_tile_size=kv_tile_size, use_sdpa_prefill=False)
    with set_forward_context(md, _kv_caches(model, num_blocks, block_size), backend):
        hidden = model(input_ids, positions)
    logits = model.compute_logits(hidden)
    return list(logits.split(lens))


@torch.no_grad()
def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    """float32 logits [len(prompt), vocab] from transformers."""
    return hf_model(torch.tensor([prompt])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers greedy decode with its KV cache (argmax, no EOS stop): (token ids, each step's logits)."""
    out = hf_model(torch.tensor([prompt]), use_cache=True)
    tokens, step_logits = [], []
    for _ in range(max_tokens):
        logits = out.logits[0, -1].float()
        tok = int(logits.argmax())
        tokens.append(tok)
        step_logits.append(logits)
        out = hf_model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, step_logits


def compare_greedy(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor],
                   tie_tol: float = 1e-3) -> tuple[bool, int, str]:
    """Near-tie rule: tokens must match until the first divergence; it is allowed only where
    HF's top-2 logits differ by <= tie_tol, and comparison of this prompt stops there.

    Returns (ok, number of tokens compared equal, message).
    """
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = torch.topk(ref_logits[j], 2).values
            gap = float(top2[0] - top2[1])
            if gap <= tie_tol:
                return True, j, f"near tie at step {j} (gap {gap:.2e})"
            return False, j, f"diverged at step {j}: ours {a} vs HF {b}, HF top-2 gap {gap:.3e}"
    if len(ours) != len(ref):
        return False, min(len(ours), len(ref)), f"lengths differ: {len(ours)} vs {len(ref)}"
    return True, len(ref), "identical"


@torch.no_grad()
def hf_teacher_forced(hf_model, prompts: list[list[int]],
                      completions: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy choice at each step of given completions: [(token ids, each step's logits)].

    One batched forward over `prompt + completion[:-1]` per row; the logits at
    the positions of prompt[-1], completion[0], ..., completion[-2] are HF's
    next-token logits after prompt + completion[:j]. Until the first j where
    HF's argmax differs from completion[j], completion[:j] IS HF's own greedy
    output, so `compare_greedy(completion, *result)` is the same check as
    against `hf_greedy` at one forward in all instead of one per token (each
    a full read of the weights: 1 GB per step for Gemma 3 270M in float32).

    Rows are right-padded with token 0 and no attention mask: under causal
    attention a real token never sees the pads after it, and positions stay
    0..n-1. Each completion must be non-empty.
    """
    rows = [p + c[:-1] for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    logits = hf_model(input_ids).logits.float()  # [rows, width, vocab]
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        steps = logits[i, len(p) - 1:len(p) - 1 + len(c)]  # [len(c), vocab]
        out.append((steps.argmax(-1).tolist(), list(steps)))
    return out
