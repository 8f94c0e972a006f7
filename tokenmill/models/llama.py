"""Llama (Touvron et al. 2023; HF `LlamaForCausalLM`) for flat, paged batches.

Layer structure (pre-norm, SwiGLU MLP, RoPE, GQA) as HF's `modeling_llama.py`;
the shell (embedding, layers, final norm, LM head, weight loading with q/k/v
and gate/up fused) is `decoder_layers.DecoderForCausalLM`. Llama contributes
only its layer: `attention_bias` on q/k/v and the output projection,
`mlp_bias` on the MLP.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.models.decoder_layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama decoder + LM head (interface of `DecoderForCausalLM`)."""

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        attn = DecoderAttention(config, layer_idx, qkv_bias=bias, o_bias=bias)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                       bias=bool(getattr(config, "mlp_bias", False)))
        return DecoderLayer(config, attn, mlp)
