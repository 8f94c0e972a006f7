"""load_hf_config / load_generation_config: folders, GGUF metadata (with its JSON cache)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill.model_loader import hf_config as hf_config_mod
from tokenmill.model_loader.hf_config import load_generation_config, load_hf_config
from tokenmill.model_loader.source import ModelSource


def _tiny_gguf(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(300)
    w.add_tensor("token_embd.weight", np.zeros((300, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_config_from_metadata_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = tmp_path / "m" / "tiny.gguf"
    gguf_path.parent.mkdir()
    _tiny_gguf(gguf_path)
    source = ModelSource(path=str(gguf_path.parent), gguf_file=str(gguf_path))
    config = load_hf_config(source)
    assert config.architectures == ["LlamaForCausalLM"]  # derived from model_type
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert (config.max_position_embeddings, config.vocab_size) == (256, 300)
    assert config.rope_parameters["rope_theta"] == 50000.0
    assert list((tmp_path / "cache" / "gguf_configs").glob("*.json"))

    import transformers

    def must_not_parse(*args, **kwargs):
        raise AssertionError("the cached config should have been used")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", must_not_parse)
    again = load_hf_config(source)
    assert again.to_dict() == config.to_dict()


def test_folder_config_and_generation_config(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=128).save_pretrained(tmp_path)
    source = ModelSource(path=str(tmp_path))
    assert load_hf_config(source).architectures == ["LlamaForCausalLM"]
    assert load_generation_config(source) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 20}))
    assert load_generation_config(source) == {"top_k": 20}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert load_generation_config(source) == {}


def test_unreadable_config_is_a_value_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="Could not read the model config"):
        load_hf_config(ModelSource(path=str(tmp_path)))


def test_cache_key_changes_with_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "x.gguf"
    f.write_bytes(b"a")
    first = hf_config_mod._gguf_config_cache_file(str(f))
    f.write_bytes(b"ab")
    assert hf_config_mod._gguf_config_cache_file(str(f)) != first
