"""Which models and steps run a one-token CPU step in one C call (`kernels/cpu/decoder_step.py`).

`DecoderModel.forward` asks `run(model, input_ids, positions)` first; it
returns the final-normed hidden state [1, H], or None and the module path
runs as before. It applies when all of these hold (checked once per model,
the plan is kept on it):

- `TOKENMILL_CPU_FUSED_DECODE` on (the default) and the C library builds;
- one rank (no tensor or pipeline parallelism);
- every layer is the plain pre-norm `DecoderLayer` with `DecoderAttention`
  (no q/k norm, sinks, soft-cap or biases, neox RoPE over the whole head, one
  RoPE table) and a SiLU `GatedMLP`, float32 norms, every linear kept as GGUF
  blocks (`GGUFWeight`): Llama, Mistral, SmolLM2 GGUFs on the CPU;

and per step: one token of one request, a float32 TORCH_SDPA cache read by the
C decode kernel (the backend's own choice for such a step), one KV group, a
valid slot. Everything else (prefill, batches, bfloat16, other families,
weights dequantized at load) keeps the module path.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import envs
from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.forward_context import get_forward_context
from tokenmill.distributed import parallel_state as ps
from tokenmill.kernels.cpu import decoder_step
from tokenmill.kernels.cpu.decode import kernel_supports
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.gguf_weights import GGUFWeight
from tokenmill.layers.rotary import RotaryEmbedding

_PLAN_ATTR = "_cpu_fused_decode_plan"  # on the DecoderModel: a DecoderStepPlan, or False once found ineligible


def build_plan(model: nn.Module) -> decoder_step.DecoderStepPlan | None:
    """The packed plan of `model` (a `DecoderModel` with loaded weights), or None when it does not qualify
    (see the module docstring)."""
    from tokenmill.models.decoder_layers import DecoderAttention, DecoderLayer, GatedMLP

    if (not envs.cpu_fused_decode() or ps.get_pp_world_size() != 1
            or ps.get_tensor_model_parallel_world_size() != 1 or decoder_step.load() is None):
        return None
    layers = list(model.layers)
    if not layers or model.start_layer != 0 or model.end_layer != len(layers):
        return None
    first = layers[0]
    if type(first) is not DecoderLayer or type(first.self_attn) is not DecoderAttention:
        return None
    rope, eps = first.self_attn.rotary_emb, model.norm.eps
    scale = first.self_attn.attn.scale
    packed = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer) is not DecoderLayer or layer.sandwich or layer.fp32_residual
                or type(attn) is not DecoderAttention or type(mlp) is not GatedMLP
                or attn.qk_norm is not None or attn.sinks is not None or attn.attn.logits_soft_cap is not None
                or attn.rotary_emb is not rope or attn.attn.scale != scale or not isinstance(mlp.act_fn, SiluAndMul)):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.gemma or n.eps != eps or n.weight.dtype != torch.float32 for n in norms):
            return None
        segments = []
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(linear.weight, GGUFWeight) or linear.bias is not None:
                return None
            if len(linear.weight.segments) > decoder_step.MAX_SEGS:
                return None
            segments.append([(s.blocks, s.qtype, s.start) for s in linear.weight.segments])
        packed.append(decoder_step.LayerWeights(norms[0].weight.data, norms[1].weight.data, tuple(segments),
                                                attn.attn.sliding_window))
    if (type(rope) is not RotaryEmbedding or not rope.is_neox_style or rope.rotary_dim != rope.head_size
            or model.norm.gemma or model.norm.weight.dtype != torch.float32):
        return None
    a, m = first.self_attn, first.mlp
    return decoder_step.DecoderStepPlan(
        packed, model.norm.weight.data, rope.cos_cache, rope.sin_cache, a.qkv_proj.weight.shape[1], a.num_heads,
        a.num_kv_heads, a.head_dim, m.down_proj.weight.shape[1], eps, scale)


def run(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """The final-normed hidden state [1, H] of a one-token step through the fused C path; None when this
    model or step does not take it (the caller runs its modules)."""
    if input_ids.shape[0] != 1 or input_ids.device.type != "cpu":
        return None
    plan = model.__dict__.get(_PLAN_ATTR)
    if plan is False:
        return None
    ctx = get_forward_context()
    md = ctx.attn_metadata
    backend = ctx.attn_backend
    if (md is None or ctx.attn_metadata_swa is not None or md.num_actual_tokens != 1 or md.num_reqs != 1
            or not isinstance(backend, TorchSDPABackend) or not backend.decode_from_cache
            or not backend.use_cpu_kernel):
        return None
    if plan is None:  # the first real step: weights are loaded by now
        plan = build_plan(model) or False
        model.__dict__[_PLAN_ATTR] = plan
        if plan is False:
            return None
    if ctx.kv_caches is not plan.cache_list:
        caches = ctx.kv_caches
        if len(caches) != len(plan.layers) or not all(
                c.dtype == torch.float32 and c.shape[3:] == caches[0].shape[3:] for c in caches):
            return None
        q = torch.empty(1, plan.shape[1], plan.shape[3])
        if not all(kernel_supports(q, c) for c in caches) or caches[0].shape[3] != plan.shape[2]:
            return None
        plan.set_kv_caches(caches)
    slot = int(md.slot_mapping[0])
    if slot < 0 or positions.dtype != torch.int64 or not positions.is_contiguous():
        return None
    block_row = md.block_table[0]
    if block_row.dtype != torch.int32 or block_row.stride(0) != 1:
        block_row = block_row.to(torch.int32).contiguous()
    hidden = model.embed(input_ids)
    if hidden.dtype != torch.float32 or not hidden.is_contiguous():
        return None
    plan.run(decoder_step.load(), hidden, positions, slot, int(md.seq_lens_cpu[0]), block_row,
             ctx.kv_caches[0].shape[2])
    return hidden
