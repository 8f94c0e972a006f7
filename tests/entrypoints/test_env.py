"""`tokenmill env` on a CPU-only machine, and its per-GPU rules with fake GPUs."""

from __future__ import annotations

import json

import torch

from tokenmill.entrypoints import env


def test_json_on_this_machine(capsys):
    assert env.main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__
    assert info["python"].count(".") == 2
    assert info["cuda_available"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert info["gpus"] == []
        assert info["cpu"]["attention_backends"]["TORCH_SDPA"] is None
        assert "CUDA GPU" in info["cpu"]["attention_backends"]["TRITON_ATTN"]


def test_text_on_this_machine(capsys):
    assert env.main([]) == 0
    out = capsys.readouterr().out
    assert f"torch          {torch.__version__}" in out
    assert "Triton" in out
    if not torch.cuda.is_available():
        assert "GPU            none" in out


def test_volta_under_a_cuda128_torch():
    gpu = env.describe_gpu(
        0, "Tesla V100-SXM2-16GB", 16 * 2**30, (7, 0),
        arch_list=["sm_75", "sm_80", "sm_90", "sm_120"], force_cc70=False,
        triton_available=True, flash_attn_available=False,
    )
    assert gpu["memory_gib"] == 16.0 and gpu["capability"] == "7.0"
    assert "cu126" in gpu["torch_kernels"]
    # With no torch kernels nothing is usable, each with a reason.
    assert all(v for v in gpu["dtypes"].values())
    assert all(v for v in gpu["attention_backends"].values())
    text = env.render_text(_info_with(gpu))
    assert "not TRITON_ATTN" in text and "cu126" in text


def test_h200_forced_to_cc70():
    gpu = env.describe_gpu(
        0, "NVIDIA H200", 141 * 2**30, (9, 0),
        arch_list=["sm_80", "sm_90"], force_cc70=True,
        triton_available=True, flash_attn_available=True,
    )
    assert gpu["torch_kernels"] is None
    assert gpu["effective_capability"] == "7.0" and gpu["default_dtype"] == "float16"
    assert gpu["dtypes"]["float16"] is None and "8.0" in gpu["dtypes"]["bfloat16"]
    assert gpu["attention_backends"]["TRITON_ATTN"] is None
    assert "8.0" in gpu["attention_backends"]["FLASH_ATTN"]
    text = env.render_text(_info_with(gpu))
    assert "treated as 7.0" in text and "not bfloat16" in text


def _info_with(gpu):
    info = env.collect_env_info()
    info["gpus"] = [gpu]
    return info


def test_quantization_methods_per_device(capsys):
    info = env.collect_env_info()
    cpu = info["cpu"]["quantization"]
    assert set(cpu) == {"awq", "gptq", "compressed-tensors", "fp8"}
    assert cpu["awq"]["bits"] == [4] and cpu["gptq"]["bits"] == [4, 8] and cpu["fp8"]["bits"] == [8]
    assert all("dequantized" in row["kernel"] for row in cpu.values())
    volta, pascal = (env.describe_gpu(0, "GPU", 16 * 2**30, cc, arch_list=["sm_60", "sm_70", "sm_90"],
                                      force_cc70=False, triton_available=True, flash_attn_available=False)
                     for cc in ((7, 0), (6, 1)))
    int_rows = [row["kernel"] for m, row in volta["quantization"].items() if m != "fp8"]
    assert int_rows and all("FMA GEMV (M = 1)" in k and "cuBLAS float16" in k for k in int_rows)
    assert "split-K" in volta["quantization"]["fp8"]["kernel"]
    assert "bit decoding" in volta["quantization"]["fp8"]["kernel"]
    assert all(row["kernel"].startswith("refused") for row in pascal["quantization"].values())
    assert env.main([]) == 0
    if not torch.cuda.is_available():
        assert "  quantized    awq int4, gptq int4/int8, compressed-tensors int4/int8, fp8 e4m3: dequantized" in \
            capsys.readouterr().out
