"""Qwen2 / Qwen2.5 (HF `Qwen2ForCausalLM`): Llama with q/k/v biases and optional sliding windows.

Sliding windows follow transformers' config: with `use_sliding_window`,
layers `i >= max_window_layers` (HF `layer_types`) attend to the last
`sliding_window` tokens; the others attend fully.
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


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 decoder + LM head (interface of `DecoderForCausalLM`)."""

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = DecoderAttention(config, layer_idx, qkv_bias=True, sliding_window=layer_sliding_window(config, layer_idx))
        return DecoderLayer(config, attn, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act))
