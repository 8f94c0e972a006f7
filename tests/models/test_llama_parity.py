"""LlamaForCausalLM vs transformers on tiny random configs, loaded through get_model from safetensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from tokenmill.config import EngineArgs
from tokenmill.model_loader import get_model

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}


def _save_tiny_llama(folder: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> HFLlamaForCausalLM:
    """A random HF Llama saved as safetensors in `folder`; norms perturbed so their loading matters."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = HFLlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def _load_ours(folder: str):
    cfg = EngineArgs(model=folder, device="cpu").create_engine_config()
    return get_model(cfg.model_config, "cpu", cfg.model_config.dtype)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
        {"head_dim": 32, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 32}},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ],
    ids=["plain", "tied-bias", "llama3-rope-head_dim", "linear-rope"],
)
def test_logits_match_transformers(tmp_path, run_tokenmill_prompt, overrides):
    hf = _save_tiny_llama(str(tmp_path), **overrides)
    ours = _load_ours(str(tmp_path))
    token_ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0].float()
    logits = run_tokenmill_prompt(ours, token_ids)
    assert logits.dtype == torch.float32
    assert logits.shape == ref.shape
    assert _rel_err(logits, ref) <= 1e-4


def test_sharded_safetensors_load_identically(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    _save_tiny_llama(str(single), seed=3)
    _save_tiny_llama(str(sharded), seed=3, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # A stale file not in the index must be ignored.
    os.link(single / "model.safetensors", sharded / "stale.safetensors")
    a, b = _load_ours(str(single)), _load_ours(str(sharded))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_missing_weight_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_tiny_llama(str(tmp_path))
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        _load_ours(str(tmp_path))


def test_unknown_checkpoint_tensor_is_an_error(tmp_path):
    _save_tiny_llama(str(tmp_path))
    model = _load_ours(str(tmp_path))
    with pytest.raises(ValueError, match="vision_tower"):
        model.load_weights([("vision_tower.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_pytorch_bin_checkpoint_loads_like_safetensors(tmp_path):
    from safetensors.torch import load_file

    st, pt = tmp_path / "st", tmp_path / "pt"
    _save_tiny_llama(str(st), seed=5)
    _save_tiny_llama(str(pt), seed=5)
    state = load_file(pt / "model.safetensors")
    (pt / "model.safetensors").unlink()
    torch.save(state, pt / "pytorch_model.bin")
    a, b = _load_ours(str(st)), _load_ours(str(pt))
    for name, w in a.state_dict().items():
        assert torch.equal(w, b.state_dict()[name]), name
    cfg = EngineArgs(model=str(pt), device="cpu", load_format="safetensors").create_engine_config()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        get_model(cfg.model_config, "cpu", "float32")
