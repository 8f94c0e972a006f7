"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): Qwen3 attention with sparse MoE blocks.

Layer i is sparse when `i not in mlp_only_layers`, `num_experts > 0` and
`(i + 1) % decoder_sparse_step == 0`; otherwise a dense gated MLP of
`intermediate_size`. Routing: softmax, top `num_experts_per_tok`,
renormalised when `norm_topk_prob` (HF `Qwen3MoeTopKRouter`); experts of
`moe_intermediate_size`. No shared experts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.models.decoder_layers import DecoderForCausalLM, DecoderLayer, GatedMLP, SparseMoeBlock
from tokenmill.models.qwen3 import qwen3_attention


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has an MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE decoder + LM head (interface of `DecoderForCausalLM`)."""

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            mlp = SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                 config.moe_intermediate_size, bool(config.norm_topk_prob), config.hidden_act)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return DecoderLayer(config, qwen3_attention(config, layer_idx), mlp)
