"""GGUF loading: names, the Q/K un-permutation, and every SmolLM2 tensor vs transformers' own GGUF loader."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenmill.model_loader.gguf_loader import gguf_to_hf_name, gguf_weights_iterator, unpermute_qk


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute, written from its description:
    # each head's rows (two halves of head_dim/2) are interleaved pairwise.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 4])
def test_unpermute_inverts_llama_cpp_permute(n_head):
    w = np.random.default_rng(0).standard_normal((n_head * 8, 5)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)
    # Row order inside one head of dim 8: [0,4,1,5,2,6,3,7] after permuting.
    rows = _llama_cpp_permute(np.arange(8.0)[:, None], 1)[:, 0]
    assert rows.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_gguf_names():
    assert gguf_to_hf_name("blk.7.attn_q.weight", "llama") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_output.weight", "llama") == "model.layers.0.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "llama") == "model.layers.2.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.1.attn_k.bias", "qwen2") == "model.layers.1.self_attn.k_proj.bias"
    assert gguf_to_hf_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight", "llama") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight", "llama") == "model.norm.weight"
    assert gguf_to_hf_name("rope_freqs.weight", "llama") is None
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight", "mamba")


def test_every_smollm2_tensor_matches_transformers(smollm2_gguf, hf_smollm2):
    hf_model, _ = hf_smollm2
    config = hf_model.config
    ref = hf_model.state_dict()
    seen = set()
    for name, tensor in gguf_weights_iterator(smollm2_gguf, SimpleNamespace(
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads)):
        assert name in ref, name
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref[name].shape, name
        assert (tensor - ref[name]).abs().max().item() <= 1e-6, name
        seen.add(name)
    # 30 layers x 9 tensors + embedding + final norm; lm_head is tied (not in the file).
    assert len(seen) == 30 * 9 + 2
    assert "lm_head.weight" not in seen
