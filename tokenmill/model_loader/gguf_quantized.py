"""Keep a GGUF model's linear weights quantized on the CPU (`layers/gguf_weights.GGUFWeight`).

The GGUF iterator (`gguf_loader.gguf_weights_iterator(..., keep_blocks=True)`)
still yields float tensors, so every model's `load_weights` runs unchanged,
but each tensor of a `KERNEL_BLOCKS` type also carries its raw block rows
(`GGUFBlocks`, Q/K rows un-permuted like the floats). Before loading,
`capture(model)` wraps the weight loaders of the linear layers and the LM
head: besides copying the floats, each call finds which output rows of the
layer the tensor filled by running the layer's own loader once more on
probe tensors (a [out, 1] column of -1 and the source row numbers), so
fused q/k/v and gate/up layers need no model-specific code, and records
those rows' blocks. `finalize(model)` then replaces the weight of every
layer whose rows all came as blocks by a `GGUFWeight` (the float copy is
freed), and gives a quantized LM head its `gguf_weight`. Tensor-parallel
size 1 only (the CPU's): a row split of the input dim is not block-aligned.

How a GGUF loads is chosen by TOKENMILL_CPU_GGUF_KERNELS (`envs.cpu_gguf_kernels`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.gguf_weights import GGUFSegment, GGUFWeight
from tokenmill.layers.linear import LinearBase

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GGUFBlocks:
    """One GGUF tensor's raw rows, riding on its float tensor as `.gguf_blocks`."""

    qtype: str  # ggml type name, a key of kernels/cpu/gguf_matmul.KERNEL_BLOCKS
    blocks: torch.Tensor  # [rows, row_bytes] uint8, row i = row i of the float tensor


@dataclass(slots=True)
class _Part:
    rows: torch.Tensor  # [n] int64 destination rows in the layer's weight, ascending
    qtype: str
    blocks: torch.Tensor  # [n, row_bytes] uint8


def capture(model: nn.Module) -> None:
    """Wrap the weight loaders of `model`'s linear layers and LM heads to record GGUF blocks (see module doc)."""
    for module in model.modules():
        if isinstance(module, (LinearBase, VocabParallelEmbedding)) and isinstance(module.weight, nn.Parameter):
            param = module.weight
            if getattr(param, "gguf_parts", None) is None:
                param.gguf_parts = []
                param.weight_loader = _recording_loader(param.weight_loader, param,
                                                        isinstance(module, VocabParallelEmbedding))


def _recording_loader(original, param: nn.Parameter, whole_table: bool):
    def loader(p: torch.Tensor, loaded: torch.Tensor, *args) -> None:
        original(p, loaded, *args)
        blocks: GGUFBlocks | None = getattr(loaded, "gguf_blocks", None)
        if blocks is None:
            return
        if whole_table:  # the (tp = 1) vocabulary table: row i -> row i
            n = min(loaded.shape[0], p.shape[0])
            param.gguf_parts.append(_Part(torch.arange(n), blocks.qtype, blocks.blocks[:n]))
            return
        probe = torch.full((p.shape[0], 1), -1.0, dtype=torch.float64)
        source = torch.arange(loaded.shape[0], dtype=torch.float64).unsqueeze(1)
        original(probe, source, *args)
        rows = (probe[:, 0] >= 0).nonzero().squeeze(1)
        param.gguf_parts.append(_Part(rows, blocks.qtype, blocks.blocks[probe[rows, 0].long()].contiguous()))

    return loader


def _segments(parts: list[_Part], out_features: int) -> list[GGUFSegment] | None:
    """Segments tiling rows [0, out_features) from the recorded parts; None unless every row came as blocks once."""
    owner = torch.full((out_features,), -1, dtype=torch.int64)
    for i, part in enumerate(parts):
        owner[part.rows] = i
    if bool((owner < 0).any()) or sum(p.rows.numel() for p in parts) != out_features:
        return None
    segments: list[GGUFSegment] = []
    for part in sorted(parts, key=lambda p: int(p.rows[0])):
        start = int(part.rows[0])
        if not torch.equal(part.rows, torch.arange(start, start + part.rows.numel())):
            return None  # not one run of rows (never seen: every loader writes a contiguous slice)
        if segments and segments[-1].qtype == part.qtype:
            last = segments[-1]
            last.blocks = torch.cat([last.blocks, part.blocks])  # one kernel call for q|k|v of one type
        else:
            segments.append(GGUFSegment(start, part.qtype, part.blocks))
    return segments


def finalize(model: nn.Module) -> int:
    """Swap in `GGUFWeight`s where every row came as blocks (see module doc); returns how many layers.

    Removes the recording loaders' state from the parameters either way.
    """
    count = 0
    quant_bytes = 0
    for module in model.modules():
        param = getattr(module, "weight", None)
        parts = getattr(param, "gguf_parts", None)
        if parts is None:
            continue
        del param.gguf_parts
        segments = _segments(parts, param.shape[0]) if parts else None
        if segments is None:
            continue
        if isinstance(module, LinearBase):
            weight = GGUFWeight(segments, param.shape[0], param.shape[1])
            del module.weight  # the float copy goes; matmul dispatches on the GGUFWeight
            module.weight = weight
        else:  # an embedding table: lookups keep the floats; the LM head using it (itself or tied) gets the blocks
            heads = [m for m in model.modules() if isinstance(m, ParallelLMHead) and m.weight is param]
            if not heads:
                continue
            weight = GGUFWeight(segments, param.shape[0], param.shape[1])
            for head in heads:
                head.gguf_weight = weight
        count += 1
        quant_bytes += weight.nbytes
    logger.info("GGUF: %d weights kept quantized on the CPU (%.1f MiB of blocks; TOKENMILL_CPU_GGUF_KERNELS=0 "
                "dequantizes at load instead)", count, quant_bytes / 2**20)
    return count
