"""Llama (Touvron et al. 2023; HF `LlamaForCausalLM`) for flat, paged batches.

Shapes: a step's tokens from all requests are flattened into one batch of T
tokens; attention separates requests through the forward context's
metadata. Layer structure (pre-norm, SwiGLU MLP, RoPE, GQA) as HF's
`modeling_llama.py`; q/k/v and gate/up are fused into single projections
and the checkpoint names are mapped onto them in `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from tokenmill.distributed.parallel_state import is_first_pp_rank, is_last_pp_rank
from tokenmill.distributed.pp_comm import IntermediateTensors
from tokenmill.layers.activation import get_act_and_mul_fn
from tokenmill.layers.attention import Attention
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.rotary import get_rope, rope_parameters_from_config
from tokenmill.models.utils import PPMissingLayer, load_weights_with_mapping, make_layers


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
        hidden_size = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // total_num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_num_heads, total_num_kv_heads, bias=bias)
        # This rank's heads may be an uneven share (whole KV-head groups); o_proj takes the matching columns.
        self.num_heads = self.qkv_proj.num_heads
        q_start = self.qkv_proj.partition.q_start
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, hidden_size, bias=bias,
                                        input_partition=(q_start * self.head_dim, self.num_heads * self.head_dim))
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
    """Embedding, decoder layers and final norm. forward(input_ids [T], positions [T]) -> [T, H].

    Pipeline-parallel: this stage builds layers [start_layer, end_layer) only;
    the embedding lives on the first stage (and the last when tied to the LM
    head), the final norm on the last. A non-first stage takes the previous
    stage's `IntermediateTensors`; a non-last stage returns its own.
    """

    def __init__(self, config) -> None:
        super().__init__()
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if is_first_pp_rank() or (tied and is_last_pp_rank()):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: LlamaDecoderLayer(config, i))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if is_last_pp_rank() else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if is_first_pp_rank():
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            assert intermediate_tensors is not None, "a non-first pipeline stage needs the previous stage's tensors"
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not is_last_pp_rank():
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama decoder + LM head.

    forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden_size]
    (model dtype); compute_logits(hidden [N, H]) -> [N, vocab_size] float32.
    Must run inside `tokenmill.attention.forward_context.set_forward_context(...)`.
    """

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", 1),
    }

    # forward takes `intermediate_tensors` (pipeline parallelism).
    supports_pp = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if is_last_pp_rank():
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if getattr(config, "tie_word_embeddings", False):
                self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

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
