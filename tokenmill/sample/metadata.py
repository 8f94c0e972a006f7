"""SamplingMetadata: one step's sampling parameters as tensors, one row per sampling request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the `Sampler` reads for one step; S = requests that sample.

    A field is None when no row needs it, so the sampler skips that pass.
    All tensors are on the logits' device.
    """

    all_greedy: bool
    all_random: bool
    # [S] float32; greedy rows hold 1.0 (they take the argmax). None if all greedy.
    temperature: torch.Tensor | None
    # [S] bool: rows that take the argmax. None unless the batch mixes kinds.
    greedy_mask: torch.Tensor | None
    # [S] int64 top-k, vocab size where off; None if no row uses top-k.
    top_k: torch.Tensor | None
    # [S] float32 in (0, 1]; None if no row uses top-p.
    top_p: torch.Tensor | None
    # [S] float32 in [0, 1]; None if no row uses min-p.
    min_p: torch.Tensor | None
    # Host int: the largest top_k of the batch (so top-k-only filtering needs no device->host read).
    max_top_k: int | None = None
    # row -> generator for seeded rows (all randomness of that row comes from it).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # [S] float32 penalties; all three None when no row has a penalty.
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    # [S, V] float32 counts of each token among the row's output tokens (with penalties).
    output_token_counts: torch.Tensor | None = None
    # [S, V] bool: token occurs in the prompt (with penalties; repetition uses prompt + output).
    prompt_token_mask: torch.Tensor | None = None
    # (rows [N] int64, token ids [N] int64, bias [N] float32): OpenAI logit_bias entries.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [S, V] bool: True where a token is NOT allowed (rows without a list are all False).
    disallowed_mask: torch.Tensor | None = None
    # (rows [N], token ids [N]): stop tokens masked because min_tokens is not reached, and bad_words' next tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # Largest `logprobs` any row asks for; None = nobody asks.
    max_num_logprobs: int | None = None
