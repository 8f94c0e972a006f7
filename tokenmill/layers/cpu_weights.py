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
`LinearBase.matmul` calls `torch.ops.mkldnn._linear_pointwise` on it. The
LM head is packed too (batch 64, SmolLM2's 49152 x 576 head: 10.3 -> 6.5 ms
per step) into its `packed_weight`: in place when it owns its weight, as a
second copy when the weight is tied to the input embedding (whose lookups
need the plain table), and then only up to `_MAX_TIED_COPY_BYTES`.
Set TOKENMILL_CPU_PACK_WEIGHTS=0 to keep plain weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill import envs
from tokenmill.layers.embedding import ParallelLMHead
from tokenmill.layers.linear import LinearBase

logger = logging.getLogger(__name__)

# oneDNN's batch-size hint for the packed layout; the packed weight serves any batch size
# (1, 64 and 2048 were measured within noise of each other).
_BATCH_HINT = 64
# A tied LM head's packed copy costs this much memory at most (SmolLM2: 54 MiB; Llama 3.2 1B: 501 MiB).
_MAX_TIED_COPY_BYTES = 512 << 20


def bf16_packing_supported() -> bool:
    """True when this torch build and CPU run oneDNN bfloat16 matmuls natively (AVX512-BF16 or AMX)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_cpu_linear_weights(model: nn.Module) -> int:
    """Replace each CPU bfloat16 2-D linear weight of `model` by its oneDNN-packed copy (LM head included).

    Call once, after the weights are loaded (a packed weight cannot be loaded
    into again). Returns the number of layers packed; 0 when disabled by
    TOKENMILL_CPU_PACK_WEIGHTS=0, on a CPU or build without native oneDNN
    bfloat16, or when the model has no such layer.
    """
    if not envs.cpu_pack_weights() or not bf16_packing_supported():
        return 0
    modules = list(model.modules())
    count = 0
    for module in modules:
        if isinstance(module, LinearBase) and _packable(module.weight):
            module.weight = nn.Parameter(_pack(module.weight), requires_grad=False)
            count += 1
        elif isinstance(module, ParallelLMHead) and module.gguf_weight is None and _packable(module.weight):
            weight = module.weight
            tied = any(m is not module and getattr(m, "weight", None) is weight for m in modules)
            if not tied:
                module.weight = nn.Parameter(_pack(weight), requires_grad=False)
                module.packed_weight = module.weight
                count += 1
            elif weight.numel() * weight.element_size() <= _MAX_TIED_COPY_BYTES:
                module.packed_weight = _pack(weight)
                count += 1
    if count:
        logger.info("Packed %d bfloat16 linear weights for oneDNN (TOKENMILL_CPU_PACK_WEIGHTS=0 turns it off)", count)
    return count


def _packable(weight: torch.Tensor) -> bool:
    # a GGUFWeight (layers/gguf_weights.py) is not a tensor and stays as it is
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and not weight.is_mkldnn)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
