"""FusedMoE: the experts of a sparse MoE block as two stacked weights, tensor-parallel.

Weights per rank (I_p = intermediate_size / tp, each rank holds a slice of
every expert's intermediate dim, as Megatron's column/row split of an MLP):

    w13_weight [E, 2 * I_p, H]   rows [0, I_p) = gate (w1), [I_p, 2 I_p) = up (w3)
    w2_weight  [E, H, I_p]       down (w2), columns split

so the expert outputs of a rank are partial sums and one all-reduce after
the block completes them. With `has_bias` (gpt-oss) each expert also has

    w13_bias [E, 2 * I_p]        gate then up, sliced like w13_weight's rows
    w2_bias  [E, H]              whole on every rank, added by rank 0 only
                                 (the all-reduce would otherwise add it tp times)
 The router (the `gate` linear) is replicated and
lives in the model. Computation: the Triton grouped GEMM on CUDA, the
PyTorch reference elsewhere (`fused_experts`).

int4/int8 experts: `quantize(scheme)` replaces the two weights by
`w13_qweight`, `w13_scales`, ... `w2_g_idx` (`layers/quant_params.py`, a
leading expert dim); the same loader shards them (w13 rows, w2 input
columns); CUDA runs `kernels.fused_experts_quant`, the CPU dequantizes
after loading (`dequantize`).

FP8 experts: `quantize(Fp8Scheme)` makes `w13_weight` / `w2_weight` float8_e4m3fn
with per-row `w13_weight_scale` / `w2_weight_scale` (`layers/fp8_params.py`;
block scales as [E, N, ceil(K / Bk)], one row of K blocks per output row).
CUDA runs `kernels.fused_experts_fp8`: W8A8 grouped GEMMs (fp8 dots) when the
checkpoint quantizes activations and the device has FP8 arithmetic (cc >= 8.9,
16-bit activations; FP8_EXPERTS_W8A8), the MoE input quantized per token (per
1 x Bk group with block scales) and the activated rows again before w2;
otherwise grouped GEMMs that decode the routed experts' e4m3 bytes in the
kernel (weight-only). A static
checkpoint's expert input_scales are checked at load and not kept: its experts
quantize dynamically, per token. The CPU dequantizes them once, after loading.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from tokenmill.layers.fp8_params import Fp8Scheme, fp8_weight, make_fp8_params, quantizing_loader
from tokenmill.layers.fused_moe.reference import fused_experts_reference, select_experts
from tokenmill.layers.quant_params import (
    QUANT_KINDS,
    InputShard,
    QuantScheme,
    load_replicated_g_idx,
    make_quant_params,
    narrow_input,
    needs_synthetic_g_idx,
    quant_tensors,
    scale_dtype,
    synthetic_g_idx,
)


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Expert computation on the best path for the device: Triton on CUDA, PyTorch elsewhere.

    Shapes as `fused_experts_reference`: hidden [T, H], w13 [E, 2I, H],
    w2 [E, H, I], topk [T, k], optional w13_bias [E, 2I], w2_bias [E, H] -> [T, H].
    """
    if hidden_states.is_cuda:
        return kernels.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation,
                                     w13_bias=w13_bias, w2_bias=w2_bias)
    return fused_experts_reference(hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)



logger = logging.getLogger(__name__)
# FP8 experts of checkpoints that quantize activations run the W8A8 mode of `kernels.fused_experts_fp8` (fp8
# dots) when this is True (else weight-only). On since its H200 run (session 10, 6abbddc: the W8A8 GPU tests of
# tests/kernels/test_fused_moe_fp8.py passed; `python benchmarks/gpu/fp8_moe.py`, Qwen3-30B-A3B experts, block
# scales, ms per layer W8A8 / weight-only / bf16: 1 token 0.046 / 0.069 / 0.051, 16: 0.142 / 0.304 / 0.209, 256:
# 0.235 / 0.942 / 0.334, 2048: 0.819 / 1.589 / 0.557; benchmarks/gpu/results/session10/visit1/fp8moek.log).
FP8_EXPERTS_W8A8 = True
# One warning per process about FP8 experts (every FusedMoE layer of a model gets the same scheme).
_FP8_EXPERTS_LOGGED = False

class FusedMoE(nn.Module):
    """Top-k routed experts with gated MLPs.

    Args:
        num_experts: E.
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: each expert's full intermediate size I (split across TP ranks).
        renormalize: renormalise the top-k routing weights to sum to 1.
        activation: "silu", "gelu" or "swigluoai" (`kernels.moe_activation`).
        reduce_results: all-reduce the partial sums across TP ranks in forward.
        has_bias: per-expert biases on both projections (module docstring).

    forward(hidden_states [T, H], router_logits [T, E]) -> [T, H].

    Raises:
        ValueError: intermediate_size not divisible by tensor_parallel_size,
            or top_k outside [1, num_experts].
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, activation: str = "silu", reduce_results: bool = True,
                 has_bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"MoE intermediate size ({intermediate_size}) is not divisible by "
                             f"tensor_parallel_size ({self.tp_size}).")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                             f"({num_experts}).")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.activation = activation
        self.reduce_results = reduce_results
        self.intermediate_size_per_partition = i_p = intermediate_size // self.tp_size
        dtype = torch.get_default_dtype()
        self.quant: QuantScheme | Fp8Scheme | None = None  # int4/int8 or FP8 experts: set by `quantize`
        self.create_weights(num_experts, hidden_size, intermediate_size, dtype)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if has_bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * i_p, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
            self.w13_bias.weight_loader = self.bias_loader
            self.w2_bias.weight_loader = self.bias_loader
            self.w13_bias.full_shape = (num_experts, 2 * intermediate_size)

    def create_weights(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        """The expert weights `w13_weight` / `w2_weight` (a packed-weight subclass makes its own instead)."""
        i_p = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i_p, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i_p, dtype=dtype), requires_grad=False)
        for part, param in (("w13", self.w13_weight), ("w2", self.w2_weight)):
            param.weight_loader = self.weight_loader
            param.moe_part = part
        # Unsharded shapes (stacked experts), for loaders that draw full tensors (dummy weights).
        self.w13_weight.full_shape = (num_experts, 2 * intermediate_size, hidden_size)
        self.w2_weight.full_shape = (num_experts, hidden_size, intermediate_size)
        # Input rows of each weight this rank holds: w13 all of H, w2 its slice of I.
        self.hidden_size = hidden_size
        self.w13_input = InputShard(0, hidden_size, hidden_size)
        self.w2_input = InputShard(self.tp_rank * i_p, i_p, intermediate_size)

    def quantize(self, scheme: QuantScheme | Fp8Scheme) -> None:
        """Replace w13_weight / w2_weight by empty int4/int8 parameters (`w13_qweight`, ..., `w2_g_idx`), or with an
        `Fp8Scheme` by FP8 ones (`w13_weight` float8_e4m3fn, `w13_weight_scale`, ...).

        Raises:
            ValueError: this rank's slice of the intermediate dim starts inside a packed int32 word (int4/int8) or
                a K block of the FP8 block scales, or int4/int8 experts have biases (the quantized kernel has none).
        """
        if isinstance(scheme, Fp8Scheme):
            self._quantize_fp8(scheme)
            return
        if self.w13_bias is not None:
            raise ValueError("int4/int8 quantization of experts with biases (gpt-oss) is not supported: the quantized "
                             "fused-MoE kernel has no bias terms; serve the checkpoint's own (MXFP4 or bf16) weights.")
        e, i_p, device = self.num_experts, self.intermediate_size_per_partition, self.w13_weight.device
        self.params_dtype, dtype = self.w13_weight.dtype, scale_dtype(self.w13_weight)
        parts = (("w13", 2 * i_p, self.w13_weight.full_shape[1], self.w13_input),
                 ("w2", self.hidden_size, self.hidden_size, self.w2_input))
        for part, rows, full_rows, shard in parts:
            setattr(self, f"{part}_weight", None)
            for kind, param in make_quant_params((e,), rows, full_rows, shard, scheme, dtype, device).items():
                param.weight_loader = self.weight_loader
                param.moe_part = part
                self.register_parameter(f"{part}_{kind}", param)
            if needs_synthetic_g_idx(scheme, shard):
                g_idx = synthetic_g_idx(scheme, shard).to(device).expand(e, -1).contiguous()
                self.register_buffer(f"{part}_g_idx", g_idx)
        self.quant = scheme

    def _quantize_fp8(self, scheme: Fp8Scheme) -> None:
        global _FP8_EXPERTS_LOGGED
        if scheme.activations is not None and not FP8_EXPERTS_W8A8 and not _FP8_EXPERTS_LOGGED:
            _FP8_EXPERTS_LOGGED = True
            logger.warning("FP8 experts run weight-only (16-bit activations): the checkpoint's %s activation "
                           "quantization applies to the linear layers (FP8_EXPERTS_W8A8 is off)", scheme.activations)
        elif scheme.activations == "static" and not _FP8_EXPERTS_LOGGED:
            _FP8_EXPERTS_LOGGED = True
            logger.warning("FP8 experts quantize their activations dynamically, per token: the checkpoint's static "
                           "input_scales apply to the linear layers only (the experts' ones are checked, not used)")
        e, i_p, device = self.num_experts, self.intermediate_size_per_partition, self.w13_weight.device
        self.params_dtype = self.w13_weight.dtype
        parts = (("w13", 2 * i_p, self.w13_weight.full_shape[1], self.w13_input),
                 ("w2", self.hidden_size, self.hidden_size, self.w2_input))
        for part, rows, full_rows, shard in parts:
            setattr(self, f"{part}_weight", None)
            for name, param in make_fp8_params((e,), rows, full_rows, shard, scheme, device, False).items():
                param.weight_loader, param.moe_part = self.weight_loader, part
                self.register_parameter(f"{part}_{name}", param)
            weight = getattr(self, f"{part}_weight")
            weight.weight_loader = quantizing_loader(self.weight_loader, getattr(self, f"{part}_weight_scale"), scheme)
        self.quant = scheme

    def fp8_dense(self, part: str, dtype: torch.dtype) -> torch.Tensor:
        """The dense [E, N, K] weight of FP8 experts' "w13" or "w2" in `dtype` (one dequantization of all experts)."""
        w, s = getattr(self, f"{part}_weight"), getattr(self, f"{part}_weight_scale")
        e, n, k = w.shape
        flat = fp8_weight(w.reshape(e * n, k), s.reshape(e * n, *s.shape[2:]), self.quant)
        return kernels.dequantize_fp8_weight(flat, dtype).reshape(e, n, k)

    def apply_fp8_experts(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          w2_bias: torch.Tensor | None) -> torch.Tensor:
        """`apply_experts` for FP8 experts through `kernels.fused_experts_fp8` (CUDA, or the Triton interpreter in
        tests): W8A8 when FP8_EXPERTS_W8A8, the checkpoint quantizes activations and the device allows it, else
        weight-only."""
        block = None if self.quant.block_k is None else (1, self.quant.block_k)  # scales repeated per row
        return kernels.fused_experts_fp8(hidden_states, self.w13_weight, self.w13_weight_scale, self.w2_weight,
                                         self.w2_weight_scale, topk_weights, topk_ids, self.activation,
                                         w13_bias=self.w13_bias, w2_bias=w2_bias, block_size=block,
                                         quantize_activations=FP8_EXPERTS_W8A8 and self.quant.activations is not None)

    def quant_tensors(self, part: str):
        """`QuantTensors` of "w13" or "w2" (after `quantize`), expert dim first."""
        assert self.quant is not None, "not a quantized layer"
        shard = self.w13_input if part == "w13" else self.w2_input
        return quant_tensors(self, f"{part}_", self.quant, shard.size)

    def dequantize(self) -> None:
        """Replace the loaded quantized experts by dense w13_weight / w2_weight in the layer's dtype (CPU path)."""
        for part in ("w13", "w2"):
            if isinstance(self.quant, Fp8Scheme):
                dense = self.fp8_dense(part, self.params_dtype)
                self._parameters.pop(f"{part}_weight_scale")
            else:
                dense = kernels.dequantize_weight(self.quant_tensors(part), self.params_dtype)
            for kind in QUANT_KINDS:
                self._parameters.pop(f"{part}_{kind}", None)
                self._buffers.pop(f"{part}_{kind}", None)
            param = nn.Parameter(dense, requires_grad=False)
            param.weight_loader, param.moe_part = self.weight_loader, part
            setattr(self, f"{part}_weight", param)
        self.quant = None

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2 I_p, H], w2 [E, H, I_p]) in the model dtype, as the expert GEMMs take them."""
        return self.w13_weight, self.w2_weight

    def bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's part of a stacked expert bias: `w13_bias` from `[E, 2I]` (gate then up
        halves), `w2_bias` from `[E, H]` (whole).

        Raises:
            ValueError: a shape that does not fit.
        """
        if param is self.w13_bias:
            i_p, rank = self.intermediate_size_per_partition, self.tp_rank
            full_i = loaded_weight.shape[-1] // 2
            loaded_weight = torch.cat([loaded_weight[..., rank * i_p:(rank + 1) * i_p],
                                       loaded_weight[..., full_i + rank * i_p:full_i + (rank + 1) * i_p]], dim=-1)
        if loaded_weight.shape != param.shape:
            raise ValueError(f"Expert bias of shape {tuple(loaded_weight.shape)} does not fit parameter of shape "
                             f"{tuple(param.shape)}.")
        param.data.copy_(loaded_weight)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None,
                      expert_id: int | None = None) -> None:
        """Copy this rank's slice of a full checkpoint tensor into `param`.

        Args:
            param: `w13_weight` or `w2_weight`, or a quantized `w13_*` / `w2_*`
                (rows split as the weight's; `w2_*` input columns as
                `quant_params.narrow_input`; w13's g_idx whole).
            loaded_weight: one expert's `[I, H]` (w1 gate / w3 up) or `[H, I]`
                (w2 down) with `expert_id`; or all experts stacked (`[E, I, H]`,
                `[E, H, I]`, or HF 5's `gate_up_proj [E, 2I, H]` with shard_id
                "w13") with expert_id None.
            shard_id: "w1", "w3", "w2" or "w13"; None = the whole stacked
                parameter ("w13" for w13_weight, "w2" for w2_weight).

        Raises:
            ValueError: an unknown shard_id or a shape that does not fit (the caller names the tensor).
        """
        i_p, rank = self.intermediate_size_per_partition, self.tp_rank
        if shard_id is None:
            shard_id = param.moe_part
        if expert_id is None:
            experts = range(self.num_experts)
            if loaded_weight.shape[0] != self.num_experts:
                raise ValueError(f"Stacked expert tensor has {loaded_weight.shape[0]} experts, expected "
                                 f"{self.num_experts}.")
        else:
            experts, loaded_weight = [expert_id], loaded_weight.unsqueeze(0)
        if getattr(param, "quant_kind", None) == "g_idx" and shard_id != "w2":  # gate and up read all of H
            for i, e in enumerate(experts):
                load_replicated_g_idx(param, param.data[e], loaded_weight[i], key=e)
            return
        if shard_id == "w13":
            full_i = loaded_weight.shape[1] // 2
            gate = loaded_weight[:, rank * i_p:(rank + 1) * i_p]
            up = loaded_weight[:, full_i + rank * i_p:full_i + (rank + 1) * i_p]
            src, dst = torch.cat([gate, up], dim=1), param.data[experts[0]:experts[-1] + 1]
        elif shard_id in ("w1", "w3"):
            offset = 0 if shard_id == "w1" else i_p
            src = loaded_weight[:, rank * i_p:(rank + 1) * i_p]
            dst = param.data[experts[0]:experts[-1] + 1, offset:offset + i_p]
        elif shard_id == "w2":
            src = narrow_input(param, loaded_weight, self.w2_input, self.quant)
            dst = param.data[experts[0]:experts[-1] + 1]
        else:
            raise ValueError(f"Unknown expert shard_id {shard_id!r}; expected 'w1', 'w2', 'w3' or 'w13'.")
        if src.shape != dst.shape:
            raise ValueError(f"Expert checkpoint tensor of shape {tuple(loaded_weight.shape)} ({shard_id}) does not "
                             f"fit parameter slice of shape {tuple(dst.shape)}.")
        dst.copy_(src)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        # Under TP the down bias joins on rank 0 only: the all-reduce sums the ranks' partial outputs.
        w2_bias = self.w2_bias if self.tp_rank == 0 else None
        out = self.apply_experts(hidden_states, topk_weights, topk_ids, w2_bias)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def apply_experts(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      w2_bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's expert outputs [T, H] for routed `topk_ids` / `topk_weights` [T, k] (before the
        all-reduce); `w2_bias` is the down bias this rank adds (None on ranks > 0). Packed-weight
        subclasses override it."""
        if isinstance(self.quant, Fp8Scheme):
            if hidden_states.is_cuda:
                return self.apply_fp8_experts(hidden_states, topk_weights, topk_ids, w2_bias)
            # the loader dequantizes CPU layers; this serves a layer built by hand
            w13, w2 = (self.fp8_dense(p, hidden_states.dtype) for p in ("w13", "w2"))
            return fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, self.activation, self.w13_bias,
                                 w2_bias)
        if self.quant is not None:  # int4/int8 experts (no expert biases in these checkpoints)
            if hidden_states.is_cuda:
                return kernels.fused_experts_quant(hidden_states, self.quant_tensors("w13"), self.quant_tensors("w2"),
                                                   topk_weights, topk_ids, self.activation)
            # the loader dequantizes CPU layers; this serves a layer built by hand
            w13, w2 = (kernels.dequantize_weight(self.quant_tensors(p), hidden_states.dtype) for p in ("w13", "w2"))
            return fused_experts_reference(hidden_states, w13, w2, topk_weights, topk_ids, self.activation)
        w13, w2 = self.expert_weights()
        return fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, self.activation, self.w13_bias, w2_bias)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"intermediate_size_per_partition={self.intermediate_size_per_partition}")


# Checkpoint projection name -> FusedMoE shard id: Mixtral's w1/w2/w3 and Qwen-MoE's gate/up/down.
_EXPERT_SHARDS = {"w1": "w1", "w3": "w3", "w2": "w2", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_SUFFIXES = "weight|qweight|scales|qzeros|g_idx|weight_scale"  # dense, int4/int8 (quant_params) or FP8 (fp8_params)
_PER_EXPERT_RE = re.compile(rf"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.({_SUFFIXES})$")
_STACKED_RE = re.compile(rf"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.({_SUFFIXES}))?$")


_EXPERT_MODULE_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")


def expert_module(module_name: str) -> tuple[str, int, str] | None:
    """(FusedMoE path, expert id, shard id) of a per-expert checkpoint module name, else None.

    `model.layers.0.mlp.experts.3.up_proj` -> ("model.layers.0.mlp.experts", 3, "w3").
    """
    m = _EXPERT_MODULE_RE.match(module_name)
    return None if m is None else (m.group(1), int(m.group(2)), _EXPERT_SHARDS[m.group(3)])


def load_expert_weight(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
    """Load `name` into a FusedMoE parameter if it is an expert weight; else return None.

    Accepts per-expert names (`...experts.3.gate_proj.weight`,
    `...experts.3.w1.weight`), transformers 5's stacked ones
    (`...experts.gate_up_proj [E, 2I, H]`, `...experts.down_proj [E, H, I]`)
    and GGUF's stacked ones (`...experts.gate_proj.weight [E, I, H]`, ...); with a quantized
    FusedMoE also `.qweight`, `.scales`, `.qzeros`, `.g_idx` in place of `.weight`
    (-> `w13_qweight`, ...). The FusedMoE module must sit at the checkpoint's `...experts` path.

    Returns:
        The parameter name written, or None when `name` is not an expert
        weight or the model has no such FusedMoE parameter (the caller then
        skips it, for a layer on another pipeline stage, or reports it).
    """
    m = _PER_EXPERT_RE.match(name)
    if m:
        prefix, expert, proj, suffix = m.groups()
        shard_id, expert_id = _EXPERT_SHARDS[proj], int(expert)
    else:
        m = _STACKED_RE.match(name)
        if not m:
            return None
        prefix, proj, suffix = m.groups()
        shard_id, expert_id = ("w13" if proj == "gate_up_proj" else _EXPERT_SHARDS[proj]), None
    target = f"{prefix}.{'w2' if shard_id == 'w2' else 'w13'}_{suffix or 'weight'}"
    param = params.get(target)
    if param is None:
        return None  # not on this pipeline stage, or no such module: the caller's generic path decides
    try:
        param.weight_loader(param, tensor, shard_id, expert_id)
    except ValueError as e:
        raise ValueError(f"Checkpoint tensor {name!r}: {e}") from e
    return target
