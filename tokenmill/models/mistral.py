"""Mistral (HF `MistralForCausalLM`): Llama with a sliding window on every layer when the config sets one.

Mistral 7B v0.1 uses `sliding_window=4096`; later versions set it to null
(full attention).
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


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral decoder + LM head (interface of `DecoderForCausalLM`)."""

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = DecoderAttention(config, layer_idx, sliding_window=layer_sliding_window(config, layer_idx))
        return DecoderLayer(config, attn, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act))
