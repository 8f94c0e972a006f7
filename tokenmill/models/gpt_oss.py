"""gpt-oss (HF `GptOssForCausalLM`; OpenAI 2025, gpt-oss-20b / gpt-oss-120b).

What differs from the shared decoder shell, as transformers' `modeling_gpt_oss.py`:

- attention: q/k/v/o biases; one learned sink logit per head that joins the
  softmax denominator and adds no value (`DecoderAttention(sinks=True)`);
  `layer_types` marks each layer "sliding_attention" (window
  `sliding_window`) or "full_attention"; YaRN RoPE with its attention factor
  (`layers/rotary.py`);
- MoE on every layer: the router (`mlp.router`, with bias) takes the top k
  logits and softmaxes over them, which equals softmax-then-top-k with
  renormalisation (exp(l_i) / sum over the k kept, either way); experts with
  biases and the clamped SwiGLU "swigluoai" (`kernels/moe_activation.py`),
  whose gate/up columns the checkpoint interleaves (gate even, up odd):
  the loader de-interleaves them into FusedMoE's [gate | up] rows;
- checkpoint experts are stacked and transposed: `experts.gate_up_proj`
  [E, H, 2I], `experts.down_proj` [E, I, H] (bf16 copies), or MXFP4
  (`quantization_config.quant_method == "mxfp4"`) `*_blocks` / `*_scales`
  in nn.Linear's [out, in] layout (`kernels/mxfp4.py`): on a GPU kept
  packed (`layers/fused_moe/mxfp4.py`, decoded tile by tile inside the
  fused-MoE grouped GEMM), elsewhere dequantized at load into the model dtype.

float16 (the cc-7.0 path): the residual stream is kept in float32
(`decoder_layers.add_norm` says why); bfloat16 and float32 keep it in the
model dtype.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.moe_activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from tokenmill.kernels.mxfp4 import check_mxfp4_shapes, dequantize_mxfp4
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.fused_moe.mxfp4 import Mxfp4FusedMoE
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.models.decoder_layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    layer_sliding_window,
    load_decoder_weights,
)

logger = logging.getLogger(__name__)

LAYER_TYPES = ("full_attention", "sliding_attention")
# ...experts.<proj><suffix>: stacked expert tensors of the HF checkpoint (bf16 or MXFP4).
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def validate_gpt_oss_config(config: Any) -> None:
    """Raise ValueError (one sentence) for a config this model cannot run as transformers would.

    Checks `layer_types` (one known entry per layer), the clamped-SwiGLU
    constants and the quantization method.
    """
    layer_types = getattr(config, "layer_types", None) or []
    if len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"gpt-oss config has {len(layer_types)} layer_types entries for "
                         f"{config.num_hidden_layers} layers; give one per layer.")
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"gpt-oss config has unknown layer_types {unknown}; each entry must be one of "
                         f"{', '.join(LAYER_TYPES)}.")
    alpha = float(getattr(config, "swiglu_alpha", SWIGLU_OAI_ALPHA))
    limit = float(getattr(config, "swiglu_limit", SWIGLU_OAI_LIMIT))
    if (alpha, limit) != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
        raise ValueError(f"gpt-oss config has swiglu_alpha {alpha} and swiglu_limit {limit}; tokenmill's "
                         f"expert activation supports the released models' {SWIGLU_OAI_ALPHA} and "
                         f"{SWIGLU_OAI_LIMIT} only.")
    method = quant_method(config)
    if method not in (None, "mxfp4"):
        raise ValueError(f"gpt-oss checkpoints quantized with {method!r} are not supported; use the MXFP4 "
                         "release or a bf16 copy.")


def quant_method(config: Any) -> str | None:
    """`quantization_config.quant_method` of a HF config (dict or object), or None."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)


def keep_mxfp4_packed(config: Any) -> bool:
    """Whether the MXFP4 experts stay packed in memory: an MXFP4 checkpoint built on a CUDA device.

    On the CPU they are dequantized at load (the dense GEMMs there are the fast path).
    """
    return quant_method(config) == "mxfp4" and torch.empty(0).device.type == "cuda"


class GptOssMoE(nn.Module):
    """`router` (replicated linear with bias) + `experts` (FusedMoE, biased, swigluoai). [T, H] -> [T, H].

    `packed`: MXFP4 experts kept packed (`Mxfp4FusedMoE`).
    """

    def __init__(self, config: Any, packed: bool = False) -> None:
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        moe_cls = Mxfp4FusedMoE if packed else FusedMoE
        self.experts = moe_cls(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                               config.intermediate_size, renormalize=True, activation="swigluoai", has_bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss decoder + LM head (interface of `DecoderForCausalLM`).

    Raises:
        ValueError: at construction, a config `validate_gpt_oss_config`
            refuses; at load, a sink, block or scale tensor whose shape
            disagrees with the config.
    """

    def __init__(self, config: Any) -> None:
        validate_gpt_oss_config(config)
        packed = keep_mxfp4_packed(config)
        super().__init__(config)
        if packed:
            logger.info("gpt-oss MXFP4 experts stay packed in device memory and are decoded to %s inside the "
                        "fused-MoE grouped GEMMs", torch.get_default_dtype())
        elif quant_method(config) == "mxfp4":
            logger.info("gpt-oss MXFP4 experts are dequantized at load to %s", torch.get_default_dtype())

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        attn = DecoderAttention(config, layer_idx, qkv_bias=True, o_bias=True,
                                sliding_window=layer_sliding_window(config, layer_idx), sinks=True)
        # float16 only (the model is built under its dtype as default): the residual stream in float32.
        fp32_residual = torch.get_default_dtype() == torch.float16
        return DecoderLayer(config, attn, GptOssMoE(config, packed=keep_mxfp4_packed(config)),
                            fp32_residual=fp32_residual)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors: experts (bf16 or MXFP4 blocks/scales) here, the rest by the shell.

        Returns the parameter names loaded. Raises ValueError for an unknown
        name or a tensor whose shape disagrees with the config.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[str, torch.Tensor] = {}  # MXFP4 half waiting for its partner: "<prefix>.<proj>_blocks" -> t

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _EXPERT_RE.match(name)
                if m is None:
                    yield name, tensor
                    continue
                prefix, proj, suffix = m.groups()
                if suffix in ("_blocks", "_scales"):
                    other = f"{prefix}.{proj}{'_scales' if suffix == '_blocks' else '_blocks'}"
                    if other not in pending:
                        pending[name] = tensor
                        continue
                    partner = pending.pop(other)
                    blocks, scales = (tensor, partner) if suffix == "_blocks" else (partner, tensor)
                    loaded.update(self._load_expert_mxfp4(params, prefix, proj, blocks, scales))
                else:
                    loaded.update(self._load_expert_dense(params, prefix, proj, suffix == "_bias", tensor))

        loaded |= load_decoder_weights(self, rest(), self.packed_modules_mapping, self.checkpoint_renames)
        if pending:
            raise ValueError(f"MXFP4 checkpoint tensor {sorted(pending)[0]!r} has no matching "
                             f"{'_scales' if sorted(pending)[0].endswith('_blocks') else '_blocks'} tensor.")
        return loaded

    def _load_expert_dense(self, params: dict[str, nn.Parameter], prefix: str, proj: str, is_bias: bool,
                           tensor: torch.Tensor) -> list[str]:
        e, h, i = self.config.num_local_experts, self.config.hidden_size, self.config.intermediate_size
        target = f"{prefix}.{'w13' if proj == 'gate_up_proj' else 'w2'}_{'bias' if is_bias else 'weight'}"
        param = params.get(target)
        if param is None:
            if f"{prefix}.w13_blocks" in params:
                raise ValueError(f"{prefix}.{proj} is a dense tensor, but quantization_config says the experts are "
                                 "MXFP4 (*_blocks / *_scales).")
            return []  # a layer on another pipeline stage
        if is_bias:
            want = (e, 2 * i) if proj == "gate_up_proj" else (e, h)
            if tuple(tensor.shape) != want:
                raise ValueError(f"{prefix}.{proj}_bias has shape {tuple(tensor.shape)}, but the config implies "
                                 f"{want}.")
            param.weight_loader(param, _deinterleave(tensor, -1) if proj == "gate_up_proj" else tensor)
            return [target]
        want = (e, h, 2 * i) if proj == "gate_up_proj" else (e, i, h)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{prefix}.{proj} has shape {tuple(tensor.shape)}, but the config implies {want}.")
        # HF keeps x @ W ([E, in, out]); FusedMoE keeps nn.Linear's [E, out, in].
        return [self._load_expert_linear(param, proj, tensor.transpose(1, 2), target)]

    def _load_expert_mxfp4(self, params: dict[str, nn.Parameter], prefix: str, proj: str, blocks: torch.Tensor,
                           scales: torch.Tensor) -> list[str]:
        e, h, i = self.config.num_local_experts, self.config.hidden_size, self.config.intermediate_size
        shape = (e, 2 * i, h) if proj == "gate_up_proj" else (e, h, i)  # [E, out, in]
        check_mxfp4_shapes(blocks, scales, shape, f"{prefix}.{proj}")
        w = "w13" if proj == "gate_up_proj" else "w2"
        if f"{prefix}.{w}_blocks" in params:  # kept packed: gate/up rows de-interleaved, bytes untouched
            names = [f"{prefix}.{w}_blocks", f"{prefix}.{w}_scales"]
            for name, t in zip(names, (blocks, scales)):
                params[name].weight_loader(params[name], _deinterleave(t, 1) if w == "w13" else t)
            return names
        target = f"{prefix}.{w}_weight"
        param = params.get(target)
        if param is None:
            return []
        dense = dequantize_mxfp4(blocks.to(param.device), scales.to(param.device), param.dtype)
        return [self._load_expert_linear(param, proj, dense, target)]

    @staticmethod
    def _load_expert_linear(param: nn.Parameter, proj: str, w: torch.Tensor, target: str) -> str:
        # w: [E, out, in]; gate_up rows interleaved (gate even, up odd) -> [gate rows; up rows].
        if proj == "gate_up_proj":
            param.weight_loader(param, _deinterleave(w, 1), "w13")
        else:
            param.weight_loader(param, w, "w2")
        return target


def _deinterleave(x: torch.Tensor, dim: int) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] along `dim` -> [g0, g1, ..., u0, u1, ...] (a new tensor)."""
    dim = dim % x.dim()
    return torch.cat([x[(slice(None),) * dim + (slice(0, None, 2),)],
                      x[(slice(None),) * dim + (slice(1, None, 2),)]], dim=dim)
