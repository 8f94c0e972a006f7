"""bfloat16 linear weights on CPU, repacked once into oneDNN's blocked layout.

torch runs a bfloat16 `F.linear` on CPU through oneDNN (AMX where the CPU
has it), and oneDNN first reorders the plain `[out, in]` weight into its
blocked layout, on every call. Packing once after loading (as Inductor's
weight freezing does, with the same two ATen ops) skips that pass: SmolLM2's
30 layers of linear weights at one thread, batch 64: 45 -> 32 ms, batch 1:
30 -> 23 ms, prefill (2048 tokens) unchanged; the results are bit-identical
to `F.linear`. float32 stays on `F.linear` (MKL): packing it was no faster
(and slower at batch 1).

A packed weight is an opaque `torch._mkldnn` tensor of the same shape and
dtype, replacing the layer's `weight` parameter (no second copy);
`LinearBase.matmul` calls `torch.ops.mkldnn._linear_pointwise` on it.
Set TOKENMILL_CPU_PACK_WEIGHTS=0 to keep plain weights.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from tokenmill.layers.linear import LinearBase

logger = logging.getLogger(__name__)

# oneDNN's batch-size hint for the packed layout; the packed weight serves any batch size
# (1, 64 and 2048 were measured within noise of each other).
_BATCH_HINT = 64


def bf16_packing_supported() -> bool:
    """True when this torch build and CPU run oneDNN bfloat16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_cpu_linear_weights(model: nn.Module) -> int:
    """Replace each CPU bfloat16 2-D linear weight of `model` by its oneDNN-packed copy.

    Call once, after the weights are loaded (a packed weight cannot be loaded
    into again). Returns the number of layers packed; 0 when disabled by
    TOKENMILL_CPU_PACK_WEIGHTS=0, on a CPU or build without native oneDNN
    bfloat16, or when the model has no such layer.
    """
    if os.environ.get("TOKENMILL_CPU_PACK_WEIGHTS", "1") == "0" or not bf16_packing_supported():
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.is_mkldnn:
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        module.weight = nn.Parameter(packed, requires_grad=False)
        count += 1
    if count:
        logger.info("Packed %d bfloat16 linear weights for oneDNN (TOKENMILL_CPU_PACK_WEIGHTS=0 turns it off)", count)
    return count
