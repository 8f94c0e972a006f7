"""RMSNorm with an optional fused residual add.

RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * w, computed
in float32 and cast back as HF's LlamaRMSNorm does. The Gemma variant
scales by (1 + w) in float32 before the cast (HF's GemmaRMSNorm), so its
checkpoint weights are stored around 0.

On CUDA, forward is one fused Triton kernel (tokenmill/kernels/triton/
rms_norm.py, same roundings); on CPU one C call (tokenmill/kernels/cpu/
elementwise.py, same roundings) where the kernels build, both through
`tokenmill.kernels.rms_norm`; the PyTorch code below is the fallback and the
reference.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import kernels


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dim.

    Args:
        hidden_size: size of the last dim.
        eps: added to the mean square.
        gemma: scale by `1 + weight` (Gemma family) instead of `weight`.

    forward(x [..., hidden_size], residual=None):
        residual None -> returns normed x (same dtype as x).
        residual given -> x = x + residual; returns (normed x, x) so the
        decoder layer carries the sum as the next residual (as vLLM's fused
        add-RMSNorm; one pass over memory on GPU kernels that fuse it).
        On CUDA one fused Triton launch, on CPU (float32/bfloat16) one C call
        (inputs not modified; outputs new contiguous tensors), else `forward_torch`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, gemma: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.gemma = gemma
        init = torch.zeros(hidden_size) if gemma else torch.ones(hidden_size)
        self.weight = nn.Parameter(init.to(torch.get_default_dtype()), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = kernels.rms_norm(x, self.weight, self.eps, self.gemma, residual)
        if out is not None:
            return out
        return self.forward_torch(x, residual)

    def forward_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward` in PyTorch ops: the CPU path, and the reference of the fused CUDA kernel."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, gemma={self.gemma}"
