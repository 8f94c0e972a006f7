"""resolve_engine_config: defaults per device and usage, limits, dtype rules, validation."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from tokenmill.config import EngineArgs
from tokenmill.config.resolve import (
    _resolve_dtype,
    _resolve_scheduler_config,
    default_prefill_tokens_with_decodes,
    default_scheduler_limits,
)
from tokenmill.platforms.cuda import CudaPlatform


@pytest.fixture
def tiny_folder(tmp_path):
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    return str(tmp_path)


def _resolve(folder, usage="llm", **kwargs):
    return EngineArgs(model=folder, device="cpu", **kwargs).create_engine_config(usage)


def test_cpu_defaults(tiny_folder):
    cfg = _resolve(tiny_folder)
    m = cfg.model_config
    assert (m.architecture, m.dtype, m.max_model_len) == ("LlamaForCausalLM", "float32", 512)
    assert m.model_path == tiny_folder and m.gguf_file is None and m.tokenizer == tiny_folder
    assert m.served_model_name == tiny_folder
    assert m.generation_config == {"temperature": 0.6, "top_p": 0.9}
    assert (cfg.scheduler_config.max_num_batched_tokens, cfg.scheduler_config.max_num_seqs) == (4096, 256)
    assert cfg.cache_config.kv_cache_memory_bytes is None  # the worker sizes it from free memory (platforms/memory.py)
    assert cfg.device_config.device == "cpu"
    server = _resolve(tiny_folder, usage="server")
    assert (server.scheduler_config.max_num_batched_tokens, server.scheduler_config.max_num_seqs) == (2048, 128)


def test_gpu_memory_utilization_on_cpu_is_logged_as_unused(tiny_folder, caplog):
    with caplog.at_level("INFO", logger="tokenmill.config.resolve"):
        assert _resolve(tiny_folder).cache_config.gpu_memory_utilization == 0.9  # the default, silently
        assert "gpu-memory-utilization" not in caplog.text
        cfg = _resolve(tiny_folder, gpu_memory_utilization=0.9)
    assert cfg.cache_config.gpu_memory_utilization == 0.9
    assert "--gpu-memory-utilization 0.9 is for GPUs and is not used on CPU" in caplog.text


def test_user_values_and_aliases(tiny_folder):
    cfg = _resolve(tiny_folder, dtype="bf16", max_model_len=100, kv_cache_memory_bytes="1G",
                   generation_config="vllm", served_model_name="tiny", skip_tokenizer_init=True, max_num_seqs=7)
    assert cfg.model_config.dtype == "bfloat16" and cfg.model_config.max_model_len == 100
    assert cfg.scheduler_config.max_model_len == 100 and cfg.scheduler_config.max_num_seqs == 7
    assert cfg.cache_config.kv_cache_memory_bytes == 1024**3
    assert cfg.model_config.generation_config == {}
    assert cfg.model_config.served_model_name == "tiny" and cfg.model_config.tokenizer is None
    assert _resolve(tiny_folder, dtype="half").model_config.dtype == "float16"
    assert _resolve(tiny_folder, dtype="fp32").model_config.dtype == "float32"


def test_max_model_len_beyond_model_is_an_error(tiny_folder):
    with pytest.raises(ValueError, match="512"):
        _resolve(tiny_folder, max_model_len=513)


def test_chunked_prefill_off_budget_covers_max_model_len(tmp_path):
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=8192).save_pretrained(tmp_path)
    cfg = _resolve(str(tmp_path), enable_chunked_prefill=False)
    assert cfg.scheduler_config.max_num_batched_tokens == 8192
    with pytest.raises(ValueError, match="chunked prefill"):
        _resolve(str(tmp_path), enable_chunked_prefill=False, max_num_batched_tokens=1000)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 12}, "block-size"),
    ({"block_size": 0}, "block-size"),
    ({"tensor_parallel_size": 0}, "tensor-parallel-size"),
    ({"gpu_memory_utilization": 0.0}, "gpu-memory-utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu-memory-utilization"),
    ({"dtype": "int8"}, "dtype"),
    ({"load_format": "npz"}, "load-format"),
    ({"long_prefill_token_threshold": -1}, "long-prefill-token-threshold must be >= 0"),
    ({"long_prefill_token_threshold": 64, "enable_chunked_prefill": False}, "needs chunked prefill"),
    ({"max_prefill_tokens_with_decodes": -1}, r"--max-prefill-tokens-with-decodes must be >= 0 \(0: off\)"),
    ({"max_prefill_tokens_with_decodes": 64, "enable_chunked_prefill": False},
     "--max-prefill-tokens-with-decodes splits prompts over steps, which needs chunked prefill"),
    ({"max_prefill_tokens_with_decodes": 4097},
     r"--max-prefill-tokens-with-decodes \(4097\) must be at most --max-num-batched-tokens \(4096\)"),
])
def test_invalid_arguments(tiny_folder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _resolve(tiny_folder, **kwargs)


def test_unknown_architecture_lists_supported(tmp_path):
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4)
    config.architectures = ["MadeUpForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"MadeUpForCausalLM.*Supported architectures: .*LlamaForCausalLM"):
        _resolve(str(tmp_path))


def test_bundled_default(smollm2_gguf):
    cfg = EngineArgs(device="cpu").create_engine_config("server")
    m = cfg.model_config
    assert m.served_model_name == "SmolLM2-135M-Instruct"
    assert m.gguf_file == smollm2_gguf and m.tokenizer == smollm2_gguf and m.model_path == smollm2_gguf
    assert (m.architecture, m.max_model_len, m.dtype) == ("LlamaForCausalLM", 8192, "float32")
    assert m.hf_config.num_key_value_heads == 3 and m.hf_config.tie_word_embeddings


class _FakeCuda(CudaPlatform):
    def __init__(self, cc, mem_gib=80):
        self.cc, self.mem = cc, mem_gib * 1024**3

    def get_device_capability(self, device_id=0):
        return self.cc

    def get_device_name(self, device_id=0):
        return f"FakeGPU cc{self.cc[0]}.{self.cc[1]}"

    def total_memory_bytes(self, device_id=0):
        return self.mem


def test_cuda_dtype_rules():
    assert _resolve_dtype("auto", _FakeCuda((9, 0))) == torch.bfloat16
    assert _resolve_dtype("auto", _FakeCuda((7, 0))) == torch.float16
    assert _resolve_dtype("float16", _FakeCuda((7, 0))) == torch.float16
    with pytest.raises(ValueError, match="FakeGPU cc7.0 does not support bfloat16"):
        _resolve_dtype("bfloat16", _FakeCuda((7, 0)))


def test_cuda_scheduler_defaults():
    assert default_scheduler_limits(_FakeCuda((9, 0), mem_gib=141), "llm") == (16384, 1024)
    assert default_scheduler_limits(_FakeCuda((9, 0), mem_gib=141), "server") == (8192, 1024)
    assert default_scheduler_limits(_FakeCuda((7, 0), mem_gib=32), "llm") == (8192, 256)
    assert default_scheduler_limits(_FakeCuda((7, 0), mem_gib=32), "server") == (2048, 256)


def test_prefill_cap_with_decodes_defaults():
    """2048 for the server on a >= 70 GiB GPU; off offline, on smaller GPUs and on CPU."""
    big, small = _FakeCuda((9, 0), mem_gib=141), _FakeCuda((8, 0), mem_gib=40)
    assert default_prefill_tokens_with_decodes(big, "server") == 2048
    assert default_prefill_tokens_with_decodes(big, "llm") == 0
    assert default_prefill_tokens_with_decodes(small, "server") == 0
    server = _resolve_scheduler_config(EngineArgs(), big, "server", 8192)
    assert (server.max_num_batched_tokens, server.max_prefill_tokens_with_decodes) == (8192, 2048)
    assert _resolve_scheduler_config(EngineArgs(), big, "llm", 8192).max_prefill_tokens_with_decodes == 0
    # A budget at or below the default cap, or no chunked prefill: nothing to cap.
    args = EngineArgs(max_num_batched_tokens=2048)
    assert _resolve_scheduler_config(args, big, "server", 8192).max_prefill_tokens_with_decodes == 0
    args = EngineArgs(enable_chunked_prefill=False)
    assert _resolve_scheduler_config(args, big, "server", 8192).max_prefill_tokens_with_decodes == 0
    # Given values win, in both usages.
    assert _resolve_scheduler_config(EngineArgs(max_prefill_tokens_with_decodes=0), big, "server",
                                     8192).max_prefill_tokens_with_decodes == 0
    assert _resolve_scheduler_config(EngineArgs(max_prefill_tokens_with_decodes=512), big, "llm",
                                     8192).max_prefill_tokens_with_decodes == 512


def test_prefill_cap_with_decodes_on_cpu(tiny_folder):
    assert _resolve(tiny_folder).scheduler_config.max_prefill_tokens_with_decodes == 0
    assert _resolve(tiny_folder, usage="server").scheduler_config.max_prefill_tokens_with_decodes == 0
    cfg = _resolve(tiny_folder, usage="server", max_prefill_tokens_with_decodes=256)
    assert cfg.scheduler_config.max_prefill_tokens_with_decodes == 256
