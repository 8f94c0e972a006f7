"""Gemma 3 text model (HF `Gemma3ForCausalLM`, Gemma Team 2025).

Differences from Llama, as transformers' `modeling_gemma3.py`:

- embeddings scaled by sqrt(hidden_size), the scale rounded to the model dtype;
- Gemma RMSNorm, x * (1 + w), and four norms per block (sandwich norm):

      h = x + post_attention_layernorm(attn(input_layernorm(x)))
      y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

- per-head q/k Gemma RMSNorm before RoPE; query scale
  `query_pre_attn_scalar ** -0.5`; final-logit soft-cap when
  `final_logit_softcapping` is set. `attn_logit_softcapping` is NOT applied:
  transformers' Gemma3Attention (5.x) keeps the value but never passes it to
  attention, and released Gemma 3 configs set it to null; we match HF;
- local layers ("sliding_attention" in `layer_types`, by default 5 of every
  6) use `sliding_window` and the local RoPE base (`rope_parameters
  ["sliding_attention"]`, formerly `rope_local_base_freq`); global layers
  full attention and the global base;
- GeGLU MLP (`hidden_activation`, gelu-tanh).

Gemma's activations overflow fp16, so the class is marked `fp16_unsafe`.
The shell and the sandwich-norm layer are `decoder_layers`' (`sandwich=True`, `gemma_norm=True`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.layers.rotary import rope_parameters_from_config
from tokenmill.models.decoder_layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, DecoderModel, GatedMLP


def gemma3_layer_type(config: Any, layer_idx: int) -> str:
    """"sliding_attention" or "full_attention" for layer `layer_idx`.

    From `config.layer_types`, else the older `sliding_window_pattern`
    (every pattern-th layer global; default 6).
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_idx]
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    return "sliding_attention" if (layer_idx + 1) % pattern else "full_attention"


def gemma3_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """RoPE parameters of a layer type; the local base comes from `rope_local_base_freq` on old configs."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return rope_parameters_from_config(config, layer_type)
    params = rope_parameters_from_config(config)
    if layer_type == "sliding_attention":
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return params


class Gemma3Model(DecoderModel):
    """`DecoderModel` with the embedding scaled by sqrt(hidden_size) and a Gemma final norm."""

    def __init__(self, config: Any, make_layer: Callable[[Any, int], nn.Module]) -> None:
        super().__init__(config, make_layer, gemma_norm=True)
        # HF multiplies by a 0-dim tensor cast to the weight dtype: use that rounded value.
        self.normalizer = torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype()).item()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 decoder + LM head (tied to the embedding unless the config unties it).

    forward(input_ids [T] int64, positions [T] int64) -> hidden [T, H];
    compute_logits(hidden [N, H]) -> [N, vocab] float32, soft-capped by
    `final_logit_softcapping` when set.
    """

    fp16_unsafe = True

    def make_model(self, config: Any) -> nn.Module:
        return Gemma3Model(config, self.make_layer)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        layer_type = gemma3_layer_type(config, layer_idx)
        bias = bool(getattr(config, "attention_bias", False))
        attn = DecoderAttention(
            config, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm="gemma",
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=config.sliding_window if layer_type == "sliding_attention" else None,
            rope_parameters=gemma3_rope_parameters(config, layer_type),
            logits_soft_cap=None,  # HF Gemma 3 ignores attn_logit_softcapping (module docstring)
        )
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, act)
        return DecoderLayer(config, attn, mlp, sandwich=True, gemma_norm=True)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states, soft_cap=getattr(self.config, "final_logit_softcapping", None))
