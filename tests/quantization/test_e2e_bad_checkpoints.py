"""Bad quantized checkpoints fail while loading, naming the tensor (and the config field), and nothing half-loads.

Each case damages a copy of one good tiny GPTQ / AWQ checkpoint and loads
it through `LLM` (start-up) or `get_model`; the error must name the tensor
or module, and no engine or model comes back.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from checkpoints import write_quantized_checkpoint
from safetensors.torch import load_file, save_file

from tokenmill import LLM
from tokenmill.config import EngineArgs
from tokenmill.model_loader import get_model


@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny_llama_dir) -> dict[str, str]:
    return {m: write_quantized_checkpoint(tiny_llama_dir, str(tmp_path_factory.mktemp(m)), m, 4, 32)
            for m in ("gptq", "awq")}


def _damaged(good: str, tmp_path, edit_tensors=None, edit_config=None) -> str:
    folder = str(tmp_path / "bad")
    shutil.copytree(good, folder)
    if edit_tensors is not None:
        path = os.path.join(folder, "model.safetensors")
        state = load_file(path)
        edit_tensors(state)
        save_file(state, path, metadata={"format": "pt"})
    if edit_config is not None:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return folder


def _load(folder: str) -> None:
    cfg = EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True).create_engine_config()
    get_model(cfg.model_config, "cpu", "float32")


def test_the_good_checkpoints_load(good):
    for folder in good.values():
        _load(folder)


def test_missing_scales(good, tmp_path):
    folder = _damaged(good["gptq"], tmp_path, lambda s: s.pop("model.layers.1.self_attn.k_proj.scales"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.scales is missing"):
        LLM(model=folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes="16M")


def test_bits_that_disagree_with_the_tensors(good, tmp_path):
    def eight_bits(config):
        config["quantization_config"]["bits"] = 8

    folder = _damaged(good["gptq"], tmp_path, edit_config=eight_bits)
    # The first tensor read that cannot be 8-bit is named (here GPTQ's symmetric zeros: 8 not 128).
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d+\.[a-z_.]+\.(qweight|scales|qzeros) .*8-bit"):
        _load(folder)


def test_unknown_quant_method(good, tmp_path):
    def unknown(config):
        config["quantization_config"]["quant_method"] = "squeezellm"

    folder = _damaged(good["awq"], tmp_path, edit_config=unknown)
    with pytest.raises(ValueError, match="quant_method"):
        _load(folder)


def test_a_shape_that_disagrees_with_the_config(good, tmp_path):
    def wider(config):  # the checkpoint's MLP is 256 wide; the config now says 512
        config["intermediate_size"] = 512

    folder = _damaged(good["awq"], tmp_path, edit_config=wider)
    with pytest.raises(ValueError, match=r"Checkpoint tensor 'model\.layers\.0\.mlp\.(gate|up|down)_proj\."
                                         r"(qweight|scales|qzeros)'"):
        _load(folder)


def test_a_fused_layer_quantized_only_in_part(good, tmp_path):
    def dense_v(state):
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            state.pop(f"model.layers.1.self_attn.v_proj.{suffix}", None)
        state["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(64, 128)

    folder = _damaged(good["gptq"], tmp_path, dense_v)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj.*all quantized or all not"):
        _load(folder)
