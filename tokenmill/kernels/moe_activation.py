"""The activation between the two expert GEMMs of a mixture-of-experts layer, in PyTorch.

The Triton fused-MoE path (`kernels/triton/fused_moe.py`) and the PyTorch
reference (`layers/fused_moe/reference.py`) both apply it to `[gate | up]`
rows; it lives here so that kernels/ imports nothing from layers/.

"swigluoai" is gpt-oss's clamped SwiGLU (OpenAI's gpt-oss reference
`swiglu`; transformers' `GptOssExperts._apply_gate`), with the released
models' constants:

    gate = min(gate, 7.0);  up = clamp(up, -7.0, 7.0)
    out  = (up + 1) * gate * sigmoid(1.702 * gate)

The checkpoint interleaves gate and up columns (gate even, up odd); the
loader de-interleaves them into the `[gate | up]` halves used here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = ("silu", "gelu", "swigluoai")
# gpt-oss's swiglu_alpha and swiglu_limit (config fields; the model refuses other values at load).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x[..., :d]) * x[..., d:] for `[gate | up]` rows (for "swigluoai" see the module docstring).

    x [..., 2d] -> [..., d], in x's dtype.

    Raises:
        ValueError: `activation` is not "silu", "gelu" (tanh approximation) or "swigluoai".
    """
    d = x.shape[-1] // 2
    if activation == "silu":
        return F.silu(x[..., :d]) * x[..., d:]
    if activation == "gelu":
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
    if activation == "swigluoai":
        gate = x[..., :d].clamp(max=SWIGLU_OAI_LIMIT)
        up = x[..., d:].clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))
    raise ValueError(f"MoE activation {activation!r} is not supported; supported: {', '.join(_ACTIVATIONS)}.")
