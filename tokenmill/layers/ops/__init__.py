"""Fused Triton kernels for the elementwise layers (RMSNorm, RoPE, gated activations).

On CUDA each of these layers is one kernel launch instead of the 2-16 small
PyTorch kernels of its reference code (tokenmill/layers/{layernorm, rotary,
activation}.py, which stay the CPU path and the numerical reference):

    RMSNorm (+ residual add)   -> triton_rms_norm.rms_norm / fused_add_rms_norm
    RotaryEmbedding            -> triton_rotary.rotary_embedding (q and k, one launch)
    SiluAndMul / GeluAndMul    -> triton_activation.silu_and_mul / gelu_and_mul

The kernels round every intermediate the reference rounds (to the activation
dtype, round to nearest even) so that they reproduce it bit for bit wherever
the reference's own operation order is known (see each module).

Env `TOKENMILL_DISABLE_FUSED_KERNELS=1` keeps the PyTorch path on CUDA too
(for bisecting a numerical difference, or a Triton that does not work on
the machine). It is read once per process, at the first CUDA forward.

The kernel modules import triton; this package's `__init__` does not, so
CPU runs never load it (and tests can set TRITON_INTERPRET before its
first import).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

DISABLE_FUSED_KERNELS_ENV = "TOKENMILL_DISABLE_FUSED_KERNELS"


def use_fused_kernels(x: torch.Tensor) -> bool:
    """True when `x` is a CUDA tensor and the fused Triton kernels are enabled and importable.

    Cheap enough for every forward: one attribute read, then a cached answer.
    """
    return x.is_cuda and _fused_kernels_available()


@functools.cache
def _fused_kernels_available() -> bool:
    if os.environ.get(DISABLE_FUSED_KERNELS_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        logger.info("%s is set: RMSNorm, RoPE and gated activations run as PyTorch ops on CUDA",
                    DISABLE_FUSED_KERNELS_ENV)
        return False
    try:
        import triton  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # missing, or fails to initialise on this machine
        logger.warning("Triton cannot be imported (%s): RMSNorm, RoPE and gated activations run as "
                       "PyTorch ops on CUDA (slower decode steps)", e)
        return False
    return True
