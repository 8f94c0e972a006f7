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


@pytest.mark.slow  # builds transformers' SmolLM2 from the GGUF (~30 s)
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


def test_fast_header_reader_matches_gguf_reader(tmp_path):
    """read_gguf vs the gguf package's own reader on a small file with arrays, odd alignment and quantized data."""
    import gguf

    from tokenmill.model_loader.gguf_file import read_gguf

    path = str(tmp_path / "t.gguf")
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("general.alignment", 64)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "\u00e9t\u00e9"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5] * 7)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((4, 6)).astype(np.float16)
    q8_src = rng.standard_normal((2, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(q8_src, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("a.weight", f32)
    writer.add_tensor("b.weight", f16)
    writer.add_tensor("c.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    assert ours.metadata["general.architecture"] == "llama" and ours.metadata["general.name"] == "tiny"
    assert ours.metadata["general.alignment"] == 64 and ours.metadata["llama.rope.freq_base"] == 10000.0
    assert "tokenizer.ggml.tokens" not in ours.metadata  # arrays are skipped
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert mine.ggml_type == theirs.tensor_type
        np.testing.assert_array_equal(ours.tensor_data(mine), theirs.data)
    np.testing.assert_array_equal(ours.tensor_data(ours.tensors[0]), f32)
    deq = gguf.quants.dequantize(ours.tensor_data(ours.tensors[2]), gguf.GGMLQuantizationType.Q8_0)
    assert deq.shape == (2, 64) and np.abs(deq - q8_src).max() < 0.05


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_fast_dequantize_bitwise_equals_gguf(qtype_name):
    import gguf

    from tokenmill.model_loader.gguf_dequant import fast_dequantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    x = np.random.default_rng(1).standard_normal((6, 96)).astype(np.float32) * 3
    raw = gguf.quants.quantize(x, qtype)
    ref = gguf.quants.dequantize(raw, qtype)
    ours = fast_dequantize(raw, qtype_name)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.reshape(6, 96), ref)
    assert np.abs(ref - x).max() < 1.0  # the round trip is a real quantization, not zeros
    assert fast_dequantize(raw, "Q6_K") is None
