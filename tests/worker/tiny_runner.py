"""Helper for worker tests: a ModelRunner over a tiny random Llama (dummy weights, KV cache allocated)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from tokenmill.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.model_loader.dummy import initialize_dummy_weights
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.worker.model_runner import ModelRunner

BLOCK = 4


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def make_tiny_runner(num_blocks: int = 32, backend: str | None = None, device: str = "cpu") -> ModelRunner:
    hf = tiny_llama_config()
    mc = ModelConfig(model="tiny", model_path="tiny", gguf_file=None, tokenizer=None, skip_tokenizer_init=True,
                     load_format="dummy", dtype="float32", seed=0, max_model_len=64,
                     architecture="LlamaForCausalLM", hf_config=hf)
    cfg = EngineConfig(mc, CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks),
                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                       ParallelConfig(), DeviceConfig(device=device, attention_backend=backend))
    runner = ModelRunner(cfg, torch.device(device))
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf)
    initialize_dummy_weights(model, seed=0, std=0.2)
    runner.model = model.to(device).eval()
    runner.initialize_kv_cache(runner.determine_num_available_blocks())
    return runner
