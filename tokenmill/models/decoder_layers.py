"""The one decoder shell of every model family, and the switches the families turn.

One attention, one MLP, one decoder layer, one model (embedding, layers loop,
final norm) and one causal-LM class (LM head, logits, weight loading) serve
all families; a family module contributes only `make_layer` and what differs:

    family      qkv bias  o bias  q/k norm  sliding window             MLP          norms
    Llama       attn_bias attn_b  no        no                         gated        pre
    Qwen2       yes       no      no        layer_types (HF)           gated        pre
    Qwen3       attn_bias attn_b  RMSNorm   layer_types (HF)           gated        pre
    Qwen3-MoE   attn_bias attn_b  RMSNorm   every layer when set       MoE / gated  pre
    Mistral     no        no      no        every layer when set       gated        pre
    Mixtral     no        no      no        every layer when set       MoE          pre
    Gemma 3     attn_bias attn_b  Gemma     layer_types / pattern      GeGLU        sandwich, Gemma
    gpt-oss     yes       yes     no        layer_types (HF)           MoE (biased) pre

gpt-oss also turns on attention sinks (`DecoderAttention(sinks=True)`) and,
in float16, the float32 residual stream (`fp32_residual`).

Sources: transformers' `modeling_{llama,qwen2,qwen3,qwen3_moe,mistral,mixtral,gemma3,gpt_oss}.py`.
Shapes: a step's tokens from all requests are flattened into one batch of T
tokens; attention separates requests through the forward context's metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.distributed.parallel_state import is_first_pp_rank, is_last_pp_rank
from tokenmill.distributed.pp_comm import IntermediateTensors
from tokenmill.layers.activation import get_act_and_mul_fn
from tokenmill.layers.attention import Attention, set_kv_scale
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.fused_moe import FusedMoE, load_expert_weight
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tokenmill.layers.rotary import get_rope, rope_parameters_from_config
from tokenmill.models import cpu_fused_decode
from tokenmill.models.utils import PPMissingLayer, checkpoint_renamer, load_weights_with_mapping, make_layers


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The attention window of layer `layer_idx` as transformers applies it (None = full attention).

    With `config.layer_types` (Qwen2/3, Gemma 3) only "sliding_attention"
    layers get `config.sliding_window`; Qwen2/3 configs already set
    sliding_window to None unless `use_sliding_window`, and mark layers
    `>= max_window_layers` as sliding. Without layer_types (Mistral,
    Mixtral, Qwen3-MoE) every layer uses `config.sliding_window` when set.
    """
    window = getattr(config, "sliding_window", None)
    if hasattr(config, "use_sliding_window") and not config.use_sliding_window:
        window = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class DecoderAttention(nn.Module):
    """GQA self-attention with RoPE and optional per-head q/k RMSNorm.

    Args:
        config: the HF text config (hidden_size, heads, head_dim, rope, ...).
        layer_idx: this layer's index (KV cache slot).
        qkv_bias / o_bias: biases of the fused q/k/v and the output projection.
        qk_norm: None, "rms" (Qwen3: RMSNorm over head_dim) or "gemma" (x * (1 + w)).
        scale: softmax scale (default head_dim ** -0.5).
        sliding_window: window in tokens (self included) or None.
        rope_parameters: override of `rope_parameters_from_config(config)`.
        logits_soft_cap: attention score soft-cap or None.
        sinks: a learned sink logit per head (`sinks` [num_heads] float32
            parameter, gpt-oss), joining each softmax denominator.

    forward(positions [T] int64, hidden_states [T, H]) -> [T, H].
    """

    def __init__(self, config: Any, layer_idx: int, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: str | None = None, scale: float | None = None, sliding_window: int | None = None,
                 rope_parameters: dict[str, Any] | None = None, logits_soft_cap: float | None = None,
                 sinks: bool = False) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // total_num_heads
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_num_heads, total_num_kv_heads,
                                          bias=qkv_bias)
        # Heads are split by whole KV-head groups, possibly unevenly; o_proj takes the matching columns.
        self.num_heads = self.qkv_proj.num_heads
        q_start = self.qkv_proj.partition.q_start
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, hidden_size, bias=o_bias,
                                        input_partition=(q_start * self.head_dim, self.num_heads * self.head_dim))
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        if qk_norm is not None:
            eps = getattr(config, "rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.head_dim, eps=eps, gemma=qk_norm == "gemma")
            self.k_norm = RMSNorm(self.head_dim, eps=eps, gemma=qk_norm == "gemma")
        self.qk_norm = qk_norm
        rope = rope_parameters if rope_parameters is not None else rope_parameters_from_config(config)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, rope)
        self.attn = Attention(self.num_heads, self.head_dim, scale if scale is not None else self.head_dim**-0.5,
                              self.num_kv_heads, layer_idx, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap)
        self.sinks: nn.Parameter | None = None
        if sinks:
            # float32 whatever the model dtype: the softmax is float32, and a bf16 checkpoint value is exact in it.
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
            self.sinks.full_shape = (total_num_heads,)
            self._q_head_start, self._total_num_heads = q_start, total_num_heads

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape != (self._total_num_heads,):
            raise ValueError(f"Attention sinks tensor has shape {tuple(loaded_weight.shape)}, but the config has "
                             f"{self._total_num_heads} attention heads (one sink per head).")
        param.data.copy_(loaded_weight[self._q_head_start:self._q_head_start + self.num_heads])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm is not None:
            # Per-head norm before RoPE (HF Qwen3Attention / Gemma3Attention).
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, self.sinks))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate/up fused (SwiGLU, or GeGLU for gelu). x [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_act_and_mul_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) + `experts` (FusedMoE). x [T, H] -> [T, H].

    Args:
        renormalize: Mixtral True; Qwen3-MoE `config.norm_topk_prob`.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                activation="gelu" if hidden_act.startswith("gelu") else "silu")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class DecoderLayer(nn.Module):
    """Pre-norm block with the residual stream carried separately (fused add + norm).

    Plain (Llama and most families):

        h = x + attn(input_layernorm(x));  y = h + mlp(post_attention_layernorm(h))

    `sandwich=True` (Gemma 3) adds a norm after each sub-block and one before the MLP:

        h = x + post_attention_layernorm(attn(input_layernorm(x)))
        y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

    `gemma_norm=True` makes every norm Gemma's x * (1 + w).
    `fp32_residual=True` carries the residual stream in float32 while the
    sub-blocks run in the model dtype (`add_norm`; gpt-oss in float16).
    forward(positions [T], hidden [T, H], residual [T, H] | None) -> (hidden, residual).
    """

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module, *, sandwich: bool = False,
                 gemma_norm: bool = False, fp32_residual: bool = False) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps=eps, gemma=gemma_norm)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, gemma=gemma_norm)
        self.sandwich = sandwich
        self.fp32_residual = fp32_residual
        if sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps=eps, gemma=gemma_norm)
            self.post_feedforward_layernorm = RMSNorm(h, eps=eps, gemma=gemma_norm)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states.float() if self.fp32_residual else hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = add_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        if not self.sandwich:
            hidden_states, residual = add_norm(self.post_attention_layernorm, hidden_states, residual)
            return self.mlp(hidden_states), residual
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the fused add + norm, or, for a float32 residual under a
    16-bit x, the sum and the norm in float32 with only the normed output cast back to x's dtype.

    Why a float32 residual (gpt-oss in float16, the cc-7.0 path): the residual
    stream of the real model grows past float16's 65504 in the last layers, and
    one inf there turns every logit NaN. The normed output is bounded by the
    norm weights, so only the sum needs the range: each layer's sub-block
    output still fits float16, the running sum does not. float32 keeps the
    sum exact to the sub-blocks' precision at 4 extra bytes per token and
    hidden unit in the step's activations (no weights change), where scaling
    the activations would need per-model constants.
    """
    if residual.dtype == x.dtype:
        return norm(x, residual)
    out, residual = norm(x.to(residual.dtype), residual)
    return out.to(x.dtype), residual


class DecoderModel(nn.Module):
    """embed_tokens, `make_layer(config, i)` for each layer, final norm. [T] ids -> [T, H].

    Pipeline-parallel: this stage builds layers [start_layer, end_layer) only;
    the embedding lives on the first stage (and the last when tied to the LM
    head), the final norm on the last; a non-first stage takes the previous
    stage's `IntermediateTensors`, a non-last stage returns its own.
    `gemma_norm` makes the final norm Gemma's x * (1 + w); a family that
    scales its embeddings overrides `embed`. A float32 residual (layers built
    with `fp32_residual`) meets the final norm through `add_norm`. A one-token
    CPU step of a float32 stack with GGUF-quantized weights runs as one C call
    when `cpu_fused_decode.run` takes it (same bits; TOKENMILL_CPU_FUSED_DECODE=0 turns it off).
    """

    def __init__(self, config: Any, make_layer: Callable[[Any, int], nn.Module], *, gemma_norm: bool = False) -> None:
        super().__init__()
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if is_first_pp_rank() or (tied and is_last_pp_rank()):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: make_layer(config, i))
        self.norm = (RMSNorm(config.hidden_size, eps=config.rms_norm_eps, gemma=gemma_norm)
                     if is_last_pp_rank() else PPMissingLayer())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if intermediate_tensors is None and input_ids.shape[0] == 1:
            # one CPU decode token of a GGUF Llama-style stack: one C call (models/cpu_fused_decode.py)
            hidden = cpu_fused_decode.run(self, input_ids, positions)
            if hidden is not None:
                return hidden
        if is_first_pp_rank():
            hidden_states, residual = self.embed(input_ids), None
        else:
            assert intermediate_tensors is not None, "a non-first pipeline stage needs the previous stage's tensors"
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not is_last_pp_rank():
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = add_norm(self.norm, hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """A decoder + LM head; a family subclasses it and defines `make_layer(config, layer_idx)`.

    forward(input_ids [T] int64, positions [T] int64) -> hidden [T, H];
    compute_logits(hidden [N, H]) -> [N, vocab] float32. Must run inside
    `tokenmill.attention.forward_context.set_forward_context(...)`.
    """

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", 1),
    }
    # checkpoint name fragment -> module path fragment (e.g. Mixtral's block_sparse_moe -> mlp)
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    # fp16 overflows in this family's activations: dtype "auto" avoids fp16 (config.resolve)
    fp16_unsafe = False

    # forward takes `intermediate_tensors` (pipeline parallelism).
    supports_pp = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self.make_model(config)
        if is_last_pp_rank():
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if getattr(config, "tie_word_embeddings", False):
                self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()

    def make_model(self, config: Any) -> nn.Module:
        return DecoderModel(config, self.make_layer)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors in (experts, fused q/k/v and gate/up included).

        Returns the parameter names loaded. Skips recomputed rotary buffers and
        `lm_head.weight` when embeddings are tied. Raises ValueError for an
        unknown name or a shape mismatch.
        """
        return load_decoder_weights(self, weights, self.packed_modules_mapping, self.checkpoint_renames)


_ROTARY_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_decoder_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         packed_modules_mapping: dict[str, tuple[str, str | int]],
                         renames: dict[str, str] | None = None) -> set[str]:
    """`load_weights_with_mapping` plus renames, tied-head skipping and MoE expert routing."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    params = dict(model.named_parameters())
    rename = checkpoint_renamer(renames)
    loaded: set[str] = set()

    def rest() -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(_ROTARY_BUFFERS) or (tied and name.startswith("lm_head.")):
                continue
            name = rename(name)
            if set_kv_scale(model, name, tensor):  # fp8 KV-cache scales: floats on the Attention layers
                continue
            target = load_expert_weight(params, name, tensor)  # expert names must not hit ".gate_proj"
            if target is not None:
                loaded.add(target)
            else:
                yield name, tensor

    loaded |= load_weights_with_mapping(model, rest(), packed_modules_mapping)
    return loaded
