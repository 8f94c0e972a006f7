"""A max_model_len the KV cache cannot hold fails at start-up (CPU).

The message gives the largest max_model_len that fits, exactly, and names
--kv-cache-memory-bytes: on CPU that flag sizes the cache (the CUDA wording,
--gpu-memory-utilization, is checked in tests/gpu/test_gpu_memory.py).
Model: a dummy-weight Llama, float32, KV 2 x 2 layers x 2 kv heads x head_dim
16 x 4 bytes = 512 bytes per token, 8 KiB per 16-token block.
"""

from __future__ import annotations

import re

import pytest
from transformers import LlamaConfig

from tokenmill import LLM

BLOCK_SIZE = 16
BYTES_PER_BLOCK = BLOCK_SIZE * 2 * 2 * 2 * 16 * 4
KV_BYTES = 128 * BYTES_PER_BLOCK + 5000  # 128 whole blocks and a remainder that holds none
FITS = 128 * BLOCK_SIZE  # 2048 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("fit_llama")
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=8192, architectures=["LlamaForCausalLM"],
                ).save_pretrained(folder)
    return str(folder)


def _start(model_dir: str, max_model_len: int) -> LLM:
    return LLM(model=model_dir, load_format="dummy", device="cpu", dtype="float32", skip_tokenizer_init=True,
               block_size=BLOCK_SIZE, kv_cache_memory_bytes=KV_BYTES, max_model_len=max_model_len, max_num_seqs=4)


def test_error_gives_the_largest_length_that_fits_and_the_cpu_flag(model_dir):
    with pytest.raises(ValueError) as info:
        _start(model_dir, 4096)
    msg = str(info.value)
    assert re.search(rf"--max-model-len {FITS}\b", msg), msg
    assert "raise --kv-cache-memory-bytes" in msg, msg
    assert "--gpu-memory-utilization" not in msg, msg  # a GPU flag is no help on CPU


def test_the_largest_length_fits_and_one_more_does_not(model_dir):
    llm = _start(model_dir, FITS)
    assert llm.llm_engine.engine_config.cache_config.num_gpu_blocks == 128
    llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match=rf"--max-model-len {FITS}\b"):
        _start(model_dir, FITS + 1)
