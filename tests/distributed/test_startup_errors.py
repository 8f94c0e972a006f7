"""Start-up errors of parallel runs: sizes, backends, devices, Ray addresses; NCCL environment defaults."""

from __future__ import annotations

import socket

import pytest

from tokenmill.config import EngineArgs, ParallelConfig
from tokenmill.distributed.init import set_nccl_env_defaults
from tokenmill.executor import get_executor_class


def _resolve(**kw):
    return EngineArgs(max_model_len=256, kv_cache_memory_bytes="32M", **kw).create_engine_config()


def test_tp_that_does_not_split_smollm2_heads_fails_with_working_sizes(smollm2_gguf):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not fit .*9 attention heads, 3 KV heads.*"
                                         r"Sizes that work: 1, 2, 3\."):
        _resolve(tensor_parallel_size=4)


def test_more_stages_than_layers_fails(smollm2_gguf):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=31 is larger than the number of layers \(30\)"):
        _resolve(pipeline_parallel_size=31)


def test_uni_backend_with_several_ranks_fails(smollm2_gguf):
    with pytest.raises(ValueError, match="uni runs one rank.*= 2; use mp"):
        _resolve(tensor_parallel_size=2, distributed_executor_backend="uni")


def test_executor_selection():
    from tokenmill.executor.multiproc import MultiprocExecutor
    from tokenmill.executor.uniproc import UniProcExecutor

    assert get_executor_class(ParallelConfig()) is UniProcExecutor
    assert get_executor_class(ParallelConfig(tensor_parallel_size=2)) is MultiprocExecutor
    assert get_executor_class(ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="mp")) \
        is MultiprocExecutor
    with pytest.raises(ValueError, match="must be one of mp, ray, uni, got 'mpi'"):
        get_executor_class(ParallelConfig(distributed_executor_backend="mpi"))


def test_more_ranks_than_gpus_fails(monkeypatch):
    import torch

    from tokenmill.executor.multiproc import check_cuda_device_count

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="= 2 ranks need 2 GPUs, but this host has 1 visible"):
        check_cuda_device_count(2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_cuda_device_count(2)


def test_unreachable_ray_address_names_it_and_how_to_start():
    from tokenmill.executor.ray_executor import check_ray_address

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=rf"No Ray cluster answers at 127.0.0.1:{port} .*ray start --head"):
        check_ray_address(f"127.0.0.1:{port}", timeout_s=2.0)
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        check_ray_address("head-node")
    check_ray_address(None)  # local / auto-detected clusters are left to Ray
    check_ray_address("auto")


def test_nccl_multicast_off_unless_user_set_it():
    env: dict[str, str] = {}
    set_nccl_env_defaults(env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env = {"NCCL_NVLS_ENABLE": "1"}
    set_nccl_env_defaults(env)
    assert env["NCCL_NVLS_ENABLE"] == "1" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


@pytest.mark.slow  # spawns the worker processes: ~10 s
def test_worker_start_up_error_reaches_the_caller(tmp_path):
    """A ValueError inside a worker process (here: a checkpoint missing tensors) is raised by LLM(...)
    with its message, and no worker process is left behind."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from tokenmill import LLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks weights for"):
        LLM(str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=2, kv_cache_memory_bytes="8M")
