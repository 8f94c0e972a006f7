"""Gated activations for fused gate_up projections (GLU variants, Shazeer 2020).

Input `[..., 2 * d]` = `[gate | up]` (as MergedColumnParallelLinear lays it
out per rank); output `[..., d]` = act(gate) * up.

On CUDA each is one fused Triton kernel (tokenmill/kernels/triton/
activation.py, same roundings); on CPU SwiGLU is one C call
(tokenmill/kernels/cpu/elementwise.py, same roundings) where the kernels
build (both through `tokenmill.kernels`); the PyTorch code is the fallback
and the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels


class SiluAndMul(nn.Module):
    """SwiGLU: silu(x[..., :d]) * x[..., d:]. x [..., 2d] -> [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.silu_and_mul(x)
        return self.forward_torch(x) if out is None else out

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` in PyTorch ops: the CPU path, and the reference of the fused CUDA kernel."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """GeGLU: gelu(x[..., :d]) * x[..., d:]. `approximate` is "tanh" (Gemma's gelu_pytorch_tanh) or "none"."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GeluAndMul approximate must be 'tanh' or 'none', got {approximate!r}.")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.gelu_and_mul(x, self.approximate)
        return self.forward_torch(x) if out is None else out

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` in PyTorch ops: the CPU path, and the reference of the fused CUDA kernel."""
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


_ACT_AND_MUL = {
    "silu": lambda: SiluAndMul(),
    "swish": lambda: SiluAndMul(),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),
    "gelu": lambda: GeluAndMul("none"),
}


def get_act_and_mul_fn(hidden_act: str) -> nn.Module:
    """The gated activation for a HF `hidden_act` / `hidden_activation` name.

    Raises:
        ValueError: the activation is not supported.
    """
    make = _ACT_AND_MUL.get(hidden_act)
    if make is None:
        raise ValueError(f"Activation {hidden_act!r} is not supported; supported: {', '.join(sorted(_ACT_AND_MUL))}.")
    return make()
