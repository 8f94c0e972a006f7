"""Architecture registry and dummy weights."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from tokenmill.config import EngineArgs
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.model_loader import get_model
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.registry import get_supported_archs, resolve_model_cls


def test_resolve_known_and_unknown():
    cls, arch = resolve_model_cls(["MadeUpModel", "LlamaForCausalLM"])
    assert cls is LlamaForCausalLM and arch == "LlamaForCausalLM"
    with pytest.raises(ValueError) as e:
        resolve_model_cls(["MadeUpModel"])
    assert "MadeUpModel" in str(e.value)
    for arch in get_supported_archs():
        assert arch in str(e.value)


def _dummy(folder, seed):
    cfg = EngineArgs(model=folder, device="cpu", load_format="dummy", seed=seed).create_engine_config()
    return get_model(cfg.model_config, "cpu", "float32")


def test_dummy_weights_deterministic(tmp_path):
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    a, b, c = _dummy(str(tmp_path), 0), _dummy(str(tmp_path), 0), _dummy(str(tmp_path), 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name, w in sa.items():
        assert torch.equal(w, sb[name]), name
    assert not torch.equal(sa["model.layers.0.self_attn.qkv_proj.weight"], sc["model.layers.0.self_attn.qkv_proj.weight"])
    norms = [m for m in a.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 1 and all(torch.all(m.weight == 1) for m in norms)
    emb = sa["model.embed_tokens.weight"]
    assert abs(emb.std().item() - 0.02) < 0.002 and emb.isfinite().all()
