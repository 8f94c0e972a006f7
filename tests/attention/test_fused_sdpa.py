"""Prefill attention through torch's fused SDPA kernel (CPU)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.metadata import AttentionMetadata

BS = 4


def test_prefill_goes_to_fused_sdpa_kernel():
    """A fresh prompt and a chunk over cached context reach torch's fused CPU kernel, not the math fallback."""
    bt = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    qsl = np.array([0, 12, 20], np.int32)
    sl = np.array([12, 14], np.int32)  # row 0: fresh prompt of 12; row 1: 8 new tokens after 6 cached
    slots = np.concatenate([np.arange(12), 16 + np.arange(6, 14)])
    md = AttentionMetadata(20, 2, 12, 14, torch.from_numpy(qsl), torch.from_numpy(sl), torch.from_numpy(bt),
                           torch.from_numpy(slots), qsl, sl)
    cache = torch.randn(2, 8, BS, 2, 8)
    q, k, v = torch.randn(20, 6, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        TorchSDPABackend().forward(q, k, v, cache, md, scale=0.3)
    names = [e.name for e in prof.events()]
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 2
    assert "aten::_scaled_dot_product_attention_math" not in names
