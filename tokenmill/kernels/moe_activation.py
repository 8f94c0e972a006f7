"""The activation between the two expert GEMMs of a mixture-of-experts layer, in PyTorch.

The Triton fused-MoE path (`kernels/triton/fused_moe.py`) and the PyTorch
reference (`layers/fused_moe/reference.py`) both apply it to `[gate | up]`
rows; it lives here so that kernels/ imports nothing from layers/.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = ("silu", "gelu")


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x[..., :d]) * x[..., d:] for `[gate | up]` rows. x [..., 2d] -> [..., d].

    Raises:
        ValueError: `activation` is not "silu" or "gelu" (tanh approximation).
    """
    d = x.shape[-1] // 2
    if activation == "silu":
        return F.silu(x[..., :d]) * x[..., d:]
    if activation == "gelu":
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
    raise ValueError(f"MoE activation {activation!r} is not supported; supported: {', '.join(_ACTIVATIONS)}.")
