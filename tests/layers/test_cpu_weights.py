"""oneDNN-packed bfloat16 linear weights on CPU: same results as F.linear, float32 untouched, an off switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.cpu_weights import bf16_packing_supported, pack_cpu_linear_weights
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear

needs_onednn_bf16 = pytest.mark.skipif(not bf16_packing_supported(), reason="no native oneDNN bfloat16 on this CPU")


def _block(dtype: torch.dtype) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList([
        QKVParallelLinear(32, 8, 4, 2, bias=True, params_dtype=dtype),
        RowParallelLinear(32, 32, bias=True, params_dtype=dtype),
        MergedColumnParallelLinear(32, [48, 48], params_dtype=dtype),
        ReplicatedLinear(96, 32, params_dtype=dtype),
    ])
    for p in layers.parameters():
        p.data.copy_(torch.randn(p.shape))
    return layers


@needs_onednn_bf16
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_packed_bf16_matches_f_linear(num_tokens):
    layers = _block(torch.bfloat16)
    xs = [torch.randn(num_tokens, layer.weight.shape[1]).bfloat16() for layer in layers]
    expected = [F.linear(x, layer.weight, layer.bias) for x, layer in zip(xs, layers)]
    assert pack_cpu_linear_weights(layers) == 4
    for x, layer, want in zip(xs, layers, expected):
        assert layer.weight.is_mkldnn and layer.weight.shape == want.shape[-1:] + x.shape[-1:]
        got = layer(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert pack_cpu_linear_weights(layers) == 0  # already packed: nothing to do


def test_float32_and_switch_off_keep_plain_weights(monkeypatch):
    layers = _block(torch.float32)
    assert pack_cpu_linear_weights(layers) == 0
    assert not any(layer.weight.is_mkldnn for layer in layers)
    monkeypatch.setenv("TOKENMILL_CPU_PACK_WEIGHTS", "0")
    layers = _block(torch.bfloat16)
    assert pack_cpu_linear_weights(layers) == 0
    assert not any(layer.weight.is_mkldnn for layer in layers)


@needs_onednn_bf16
@pytest.mark.parametrize("tied", [False, True])
def test_packed_bf16_lm_head(tied):
    from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": VocabParallelEmbedding(100, 32, torch.bfloat16),
                           "head": ParallelLMHead(100, 32, params_dtype=torch.bfloat16)})
    model["embed"].weight.data.copy_(torch.randn(100, 32))
    model["head"].weight.data.copy_(torch.randn(100, 32))
    if tied:
        model["head"].tie_weights(model["embed"])
    hidden = torch.randn(5, 32).bfloat16()
    want = model["head"].compute_logits(hidden)
    assert pack_cpu_linear_weights(model) == 1
    torch.testing.assert_close(model["head"].compute_logits(hidden), want, atol=0, rtol=0)
    assert model["head"].packed_weight is not None
    # A tied head packs a copy: the embedding keeps its plain table for lookups.
    if tied:
        assert not model["embed"].weight.is_mkldnn
    else:
        assert model["head"].weight.is_mkldnn  # in place, no second copy
    torch.testing.assert_close(model["embed"](torch.tensor([3, 7])), model["embed"].weight[[3, 7]])
