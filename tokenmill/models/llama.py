"""Llama (Touvron et al. 2023; HF `LlamaForCausalLM`) for flat, paged batches.

Shapes: a step's tokens from all requests are flattened into one batch of T
tokens; attention separates requests through the forward context's
metadata. Layer structure (pre-norm, SwiGLU MLP, RoPE, GQA) as HF's
`modeling_llama.py`; q/k/v and gate/up are fused into single projections
and the checkpoint names are mapped onto them in `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.distributed.parallel_state import get_tensor_model_parallel_world_size
from tokenmill.layers.activation import get_act_and_mul_fn
from tokenmill.layers.attention import Attention
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.rotary import get_rope, rope_parameters_from_config
from tokenmill.models.utils import load_weights_with_mapping


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)). x [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_act_and_mul_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention with RoPE and grouped-query heads. forward(positions [T], x [T, H]) -> [T, H]."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        hidden_size = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // total_num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_num_heads, total_num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, hidden_size, bias=bias)
        self.num_heads = total_num_heads // tp
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, rope_parameters_from_config(config))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_idx)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; carries the residual stream separately (fused add + norm)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm. forward(input_ids [T], positions [T]) -> [T, H]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama decoder + LM head.

    forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden_size]
    (model dtype); compute_logits(hidden [N, H]) -> [N, vocab_size] float32.
    Must run inside `tokenmill.forward_context.set_forward_context(...)`.
    """

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping = {
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", 1),
    }

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into the model; returns the parameter names loaded.

        Skips `rotary_emb.inv_freq` (recomputed) and `lm_head.weight` when the
        embeddings are tied. Raises ValueError for an unknown name or a shape mismatch.
        """
        skip = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
        tied = bool(getattr(self.config, "tie_word_embeddings", False))

        def keep(name: str) -> bool:
            return not name.endswith(skip) and not (tied and name.startswith("lm_head."))

        return load_weights_with_mapping(self, ((n, w) for n, w in weights if keep(n)), self.packed_modules_mapping)
