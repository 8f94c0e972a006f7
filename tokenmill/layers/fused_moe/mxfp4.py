"""Mxfp4FusedMoE: FusedMoE whose expert weights stay MXFP4-packed in device memory (gpt-oss on a GPU).

Parameters per rank (`kernels/mxfp4.py` layout, nn.Linear's [out, in] rows):

    w13_blocks [E, 2 I_p, H / 32, 16] uint8   rows: gate [0, I_p), up [I_p, 2 I_p)
    w13_scales [E, 2 I_p, H / 32]     uint8
    w2_blocks  [E, H, I_p / 32, 16]   uint8   input columns split by 32-value groups
    w2_scales  [E, H, I_p / 32]       uint8

4.25 bits per weight instead of 16: gpt-oss-120b's experts take 61 GB
instead of 229 GB, so the model fits one 141 GB GPU. On CUDA the forward
runs `kernels.fused_experts_mxfp4`: grouped GEMMs that read the routed
experts' packed tiles and decode them in registers inside the K loop
(`kernels/triton/fused_moe_mxfp4.py`, also the cc-7.0 float16 path); no
dense copy of any expert exists. Elsewhere (a CPU layer built packed, as the
tests force) it decodes the experts (`expert_weights`) and runs the PyTorch
reference; the CPU loader normally dequantizes at load instead.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.layers.fused_moe.layer import FusedMoE
from tokenmill.layers.fused_moe.reference import fused_experts_reference

_BLOCK = 32  # values per MXFP4 scale
# E8M0 scale byte of dummy weights: 2^(119 - 127) = 1/256, codes up to 6 -> |w| <= 0.023 (normal(0, 0.02)'s scale).
_DUMMY_SCALE = 119


class Mxfp4FusedMoE(FusedMoE):
    """FusedMoE with MXFP4-packed experts (module docstring); same constructor and forward.

    Raises:
        ValueError: hidden_size or this rank's intermediate size is not a
            multiple of 32 (an MXFP4 scale group may not straddle ranks).
    """

    def create_weights(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        """Packed expert parameters: `w13_blocks` [E, 2 I_p, H / 32, 16] uint8 and `w13_scales` [E, 2 I_p, H / 32]
        uint8 (E8M0), `w2_blocks` [E, H, I_p / 32, 16], `w2_scales` [E, H, I_p / 32]; `dtype` is what they decode to.

        Raises:
            ValueError: H or the per-rank intermediate size is not a multiple of 32.
        """
        i_p = self.intermediate_size_per_partition
        if hidden_size % _BLOCK or i_p % _BLOCK:
            raise ValueError(f"MXFP4 experts need hidden_size ({hidden_size}) and the per-rank intermediate size "
                             f"({i_p} = {intermediate_size} / tensor_parallel_size {self.tp_size}) to be multiples "
                             f"of {_BLOCK}; use another tensor_parallel_size.")
        self.dtype = dtype
        shapes = {"w13_blocks": (num_experts, 2 * i_p, hidden_size // _BLOCK, _BLOCK // 2),
                  "w13_scales": (num_experts, 2 * i_p, hidden_size // _BLOCK),
                  "w2_blocks": (num_experts, hidden_size, i_p // _BLOCK, _BLOCK // 2),
                  "w2_scales": (num_experts, hidden_size, i_p // _BLOCK)}
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
            param.weight_loader = self.packed_loader
            param.dummy_init = _dummy_init
            setattr(self, name, param)

    def packed_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's part of a full `[E, out, in / 32, (16)]` blocks or scales tensor whose w13 rows are
        already [gate; up] (the model de-interleaves gpt-oss's rows first).

        Raises:
            ValueError: a shape that does not fit; on CUDA, scale bytes the GPU kernels cannot decode
                (`check_gpu_scale_bytes`).
        """
        i_p, rank = self.intermediate_size_per_partition, self.tp_rank
        if param is self.w13_blocks or param is self.w13_scales:
            full_i = loaded.shape[1] // 2
            loaded = torch.cat([loaded[:, rank * i_p:(rank + 1) * i_p],
                                loaded[:, full_i + rank * i_p:full_i + (rank + 1) * i_p]], dim=1)
        else:
            groups = i_p // _BLOCK
            loaded = loaded[:, :, rank * groups:(rank + 1) * groups]
        if loaded.shape != param.shape:
            raise ValueError(f"MXFP4 expert tensor of shape {tuple(loaded.shape)} (this rank's part) does not fit "
                             f"parameter of shape {tuple(param.shape)}.")
        if param.is_cuda and (param is self.w13_scales or param is self.w2_scales):
            check_gpu_scale_bytes("w13_scales" if param is self.w13_scales else "w2_scales", loaded)
        param.data.copy_(loaded)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2 I_p, H], w2 [E, H, I_p]) in the model dtype, decoded from the packed MXFP4 blocks (dense
        copies; the CUDA forward never makes them)."""
        return (kernels.dequantize_mxfp4(self.w13_blocks, self.w13_scales, self.dtype),
                kernels.dequantize_mxfp4(self.w2_blocks, self.w2_scales, self.dtype))

    def apply_experts(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      w2_bias: torch.Tensor | None) -> torch.Tensor:
        """`FusedMoE.apply_experts` on the packed weights: the MXFP4 grouped GEMMs on CUDA, decode then the
        PyTorch reference elsewhere."""
        if hidden_states.is_cuda:
            return kernels.fused_experts_mxfp4(hidden_states, self.w13_blocks, self.w13_scales, self.w2_blocks,
                                               self.w2_scales, topk_weights, topk_ids, self.activation,
                                               self.w13_bias, w2_bias)
        w13, w2 = self.expert_weights()
        return fused_experts_reference(hidden_states, w13, w2, topk_weights, topk_ids, self.activation,
                                       self.w13_bias, w2_bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", weights=mxfp4"


@torch.no_grad()
def check_gpu_scale_bytes(name: str, scales: torch.Tensor) -> None:
    """Refuse E8M0 scale bytes (uint8, any shape) that the GPU kernels cannot decode: they build 2^(e - 127)
    from bits (`kernels/triton/fused_moe_mxfp4.py`), exact for bytes 2..252; 255 is NaN in the OCP MX spec.

    Raises:
        ValueError: a byte outside 2..252, naming the tensor and the range found.
    """
    if not scales.numel():
        return
    lo, hi = int(scales.min()), int(scales.max())
    if lo < 2 or hi > 252:
        raise ValueError(f"MXFP4 {name} holds E8M0 scale bytes {lo}..{hi}; the GPU kernels take 2..252 "
                         f"(2^-125 .. 2^125; 255 is NaN), so this checkpoint cannot run on the GPU.")


def _dummy_init(param: nn.Parameter, seed: int) -> None:
    """Dummy MXFP4: uniform random codes (blocks), scale 2^-8 (scales)."""
    if param.dim() == 4:
        gen = torch.Generator(device=param.device)
        gen.manual_seed(seed)
        param.copy_(torch.randint(0, 256, param.shape, generator=gen, device=param.device, dtype=torch.uint8))
    else:
        param.fill_(_DUMMY_SCALE)
