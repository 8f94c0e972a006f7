"""Dummy weights are drawn on the parameters' device (no CPU detour for a GPU model), deterministically."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig

from tokenmill.model_loader import dummy
from tokenmill.models.qwen3_moe import Qwen3MoeForCausalLM


def _tiny_moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                          architectures=["Qwen3MoeForCausalLM"])


def _build(device: str) -> torch.nn.Module:
    with torch.device(device):
        return Qwen3MoeForCausalLM(_tiny_moe_config())


def test_draw_normal_is_seeded_and_on_the_device():
    a, b, c = (dummy.draw_normal((64, 32), "cpu", s, 0.02) for s in (7, 7, 8))
    assert a.device.type == "cpu" and a.dtype == torch.float32 and a.shape == (64, 32)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(a.std().item() - 0.02) < 0.003


def test_every_draw_happens_on_the_parameter_device(monkeypatch):
    """A model built on 'meta' stands in for a GPU model: no value may be drawn on the CPU for it."""
    devices = []

    def fake_draw(shape, device, seed, std):
        devices.append(torch.device(device).type)
        return torch.empty(shape, dtype=torch.float32, device=device)

    monkeypatch.setattr(dummy, "draw_normal", fake_draw)
    model = _build("meta")
    dummy.initialize_dummy_weights(model, seed=0)
    # embed, lm_head, and per layer qkv, o, gate (router), w13, w2 (norms are filled, not drawn)
    assert len(devices) == 2 + 2 * 5
    assert set(devices) == {"meta"}


def test_cpu_dummy_weights_are_deterministic_and_norms_are_one():
    a, b = _build("cpu"), _build("cpu")
    dummy.initialize_dummy_weights(a, seed=3)
    dummy.initialize_dummy_weights(b, seed=3)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name
    sd = a.state_dict()
    assert torch.all(sd["model.norm.weight"] == 1)
    w13 = sd["model.layers.0.mlp.experts.w13_weight"]
    assert w13.abs().sum() > 0 and abs(w13.std().item() - 0.02) < 0.005


@pytest.mark.gpu
def test_cuda_dummy_weights_are_deterministic_on_the_gpu():
    a, b = _build("cuda"), _build("cuda")
    dummy.initialize_dummy_weights(a, seed=3)
    dummy.initialize_dummy_weights(b, seed=3)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert x.is_cuda and torch.equal(x, y), name
