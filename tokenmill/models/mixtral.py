"""Mixtral (HF `MixtralForCausalLM`; Jiang et al. 2024): Mistral attention, every MLP a sparse MoE.

Routing: softmax over `num_local_experts`, top `num_experts_per_tok`,
always renormalised (HF `MixtralTopKRouter`). Checkpoint names
`block_sparse_moe.{gate, experts.N.w1/w2/w3}` load into `mlp.{gate, experts}`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.models.decoder_layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    SparseMoeBlock,
    layer_sliding_window,
)


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral decoder + LM head (interface of `DecoderForCausalLM`)."""

    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = DecoderAttention(config, layer_idx, sliding_window=layer_sliding_window(config, layer_idx))
        moe = SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                             config.intermediate_size, renormalize=True, hidden_act=config.hidden_act)
        return DecoderLayer(config, attn, moe)
