"""Qwen3 (HF `Qwen3ForCausalLM`): Qwen2 without the fixed q/k/v bias, plus per-head q/k RMSNorm before RoPE.

`attention_bias` switches the q/k/v and output biases together; sliding
windows as Qwen2 (`layer_types`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.models.decoder_layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    GatedMLP,
    layer_sliding_window,
)


def qwen3_attention(config: Any, layer_idx: int) -> DecoderAttention:
    """Qwen3 / Qwen3-MoE self-attention of layer `layer_idx`."""
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderAttention(config, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm="rms",
                            sliding_window=layer_sliding_window(config, layer_idx))


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 decoder + LM head (interface of `DecoderForCausalLM`)."""

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return DecoderLayer(config, qwen3_attention(config, layer_idx), mlp)
