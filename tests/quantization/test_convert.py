"""Checkpoints written in each format's published layout convert into tokenmill's layout exactly.

For every format, bits, group size, act-order and symmetry: the checkpoint
(tests/quantization/checkpoints.py) is dequantized by the reference
library's code (compressed-tensors' decompressor, AutoAWQ's
dequantize_gemm, the reading of GPTQModel's dequantize_weight), and
tokenmill's converted tensors, dequantized by quant_pack.dequantize, must
equal it bit for bit; the quantization error against the dense weights must
be that of round-to-nearest at those bits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import (
    quantize_state_dict,
    read_state_dict,
    reference_dequantized_state_dict,
    write_quantized_checkpoint,
)
from optional_deps import missing, require
from references import autoawq_packing_utils

from tokenmill.kernels.quant_pack import dequantize, pack_factor
from tokenmill.quantization import convert_weights, find_quantization_config, quantized_modules, resolve_quantization

require("compressed_tensors", "compressed-tensors")
if autoawq_packing_utils() is None:  # `import awq` itself needs AutoAWQ's training deps; its unpacking code does not
    missing("autoawq")

# (method, bits, group_size, act_order, symmetric)
CASES = [
    ("awq", 4, 128, False, False),
    ("awq", 4, 64, False, False),
    ("awq", 4, 32, False, True),
    ("awq", 4, -1, False, False),
    ("gptq", 4, 128, False, True),
    ("gptq", 4, 128, True, True),
    ("gptq", 4, 32, True, False),
    ("gptq", 4, 64, False, False),
    ("gptq", 8, -1, False, True),
    ("gptq", 8, 128, True, False),
    ("gptq", 4, -1, True, False),
    ("compressed-tensors", 4, 128, False, True),
    ("compressed-tensors", 8, -1, False, True),
    ("compressed-tensors", 4, 32, False, False),
    ("compressed-tensors", 8, -1, False, False),
    ("compressed-tensors", 4, 64, True, True),
    ("compressed-tensors", 8, 128, True, False),
]


def _load(folder: str):
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    cfg = resolve_quantization(find_quantization_config(folder, hf), None)
    return cfg, read_state_dict(folder)


def _check_exact(folder: str, dense: dict[str, torch.Tensor], expect_modules: int) -> None:
    cfg, state = _load(folder)
    ref = reference_dequantized_state_dict(folder)
    converted = dict(convert_weights(cfg, state.items()))
    modules = quantized_modules(cfg, state)
    assert len(modules) == expect_modules
    p = pack_factor(cfg.bits)
    worst = 0.0
    for m in sorted(modules):
        want = ref[f"{m}.weight"]
        n, k = want.shape
        qweight, scales = converted.pop(f"{m}.qweight"), converted.pop(f"{m}.scales")
        qzeros, g_idx = converted.pop(f"{m}.qzeros", None), converted.pop(f"{m}.g_idx", None)
        assert qweight.dtype == torch.int32 and list(qweight.shape) == [n, -(-k // p)]
        assert list(scales.shape) == [n, 1 if cfg.group_size == -1 else -(-k // cfg.group_size)]
        assert (qzeros is not None) == cfg.has_zeros and (g_idx is not None) == cfg.act_order
        if qzeros is not None:
            assert qzeros.dtype == torch.uint8 and qzeros.shape == scales.shape
        if g_idx is not None:
            assert g_idx.dtype == torch.int32 and list(g_idx.shape) == [k]
        got = dequantize(qweight, scales, qzeros, g_idx, cfg.bits, cfg.group_size, k)
        assert got.dtype == want.dtype
        assert torch.equal(got, want), f"{m}: max |diff| {(got.float() - want.float()).abs().max()}"
        w = dense[f"{m}.weight"]
        worst = max(worst, ((got.float() - w).abs().max() / w.abs().max()).item())
    # Round-to-nearest error: half a step of (range / levels); 4-bit groups stay well under 10% of max|w|.
    assert 0 < worst < (0.1 if cfg.bits == 4 else 0.01)
    # Everything else passed through unchanged, under its own name.
    assert set(converted) == set(ref) - {f"{m}.weight" for m in modules}
    for name, t in converted.items():
        assert torch.equal(t, ref[name]), name


IDS = [f"{m}-w{b}-g{g}{'-act' if a else ''}-{'sym' if s else 'asym'}" for m, b, g, a, s in CASES]


@pytest.mark.parametrize("method, bits, group_size, act_order, symmetric", CASES, ids=IDS)
def test_llama_checkpoint_converts_exactly(tiny_llama_dir, tmp_path, method, bits, group_size, act_order, symmetric):
    out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path), method, bits, group_size, act_order, symmetric)
    _check_exact(out, read_state_dict(tiny_llama_dir), expect_modules=2 * 7)


@pytest.mark.parametrize("method, bits, group_size, act_order", [
    ("awq", 4, 128, False), ("gptq", 4, 128, False), ("gptq", 4, 64, True), ("compressed-tensors", 4, 128, False),
    ("compressed-tensors", 8, -1, False)])
def test_qwen3_moe_checkpoint_converts_per_expert(tiny_qwen3_moe_dir, tmp_path, method, bits, group_size, act_order):
    out = write_quantized_checkpoint(tiny_qwen3_moe_dir, str(tmp_path), method, bits, group_size, act_order)
    cfg, state = _load(out)
    # The real tools leave the router, embeddings, norms and lm_head in 16 bits; experts are per-expert modules.
    assert "model.layers.1.mlp.gate.weight" in state and "lm_head.weight" in state
    modules = quantized_modules(cfg, state)
    assert {f"model.layers.1.mlp.experts.{e}.{proj}" for e in range(4) for proj in ("gate_proj", "up_proj",
                                                                                     "down_proj")} <= modules
    assert "model.layers.1.mlp.gate" not in modules
    # layer 0: 4 attention + 3 dense MLP projections; layer 1: 4 attention + 4 experts x 3
    _check_exact(out, read_state_dict(tiny_qwen3_moe_dir), expect_modules=7 + 4 + 12)


@pytest.mark.parametrize("method, bits, group_size", [("awq", 4, 64), ("gptq", 8, 128),
                                                       ("compressed-tensors", 4, 128)])
def test_qwen3_checkpoint_converts(tiny_qwen3_dir, tmp_path, method, bits, group_size):
    out = write_quantized_checkpoint(tiny_qwen3_dir, str(tmp_path), method, bits, group_size)
    state = read_state_dict(out)
    assert "model.layers.0.self_attn.q_norm.weight" in state  # norms stay dense
    _check_exact(out, read_state_dict(tiny_qwen3_dir), expect_modules=2 * 7)


def test_quantize_state_dict_in_memory(tiny_llama_dir):
    dense = read_state_dict(tiny_llama_dir)
    tensors, qcfg = quantize_state_dict(dense, "gptq", 4, 64, act_order=True)
    cfg = resolve_quantization(qcfg, "gptq")
    assert cfg.act_order and cfg.group_size == 64
    converted = dict(convert_weights(cfg, tensors.items()))
    m = "model.layers.0.self_attn.o_proj"
    got = dequantize(converted[f"{m}.qweight"], converted[f"{m}.scales"], converted.get(f"{m}.qzeros"),
                     converted[f"{m}.g_idx"], 4, 64, 128)
    assert ((got.float() - dense[f"{m}.weight"]).abs().max() / dense[f"{m}.weight"].abs().max()) < 0.1
    assert torch.equal(converted["model.embed_tokens.weight"], dense["model.embed_tokens.weight"])


def test_stacked_experts_are_written_per_expert(tiny_qwen3_moe_dir, tmp_path):
    """HF 5 may store experts stacked (`experts.gate_up_proj` [E, 2I, H]); the writer splits them like the tools."""
    from safetensors.torch import save_file

    dense = read_state_dict(tiny_qwen3_moe_dir)
    stacked, prefix = dict(dense), "model.layers.1.mlp.experts"
    gate_up = [torch.cat([dense[f"{prefix}.{e}.gate_proj.weight"], dense[f"{prefix}.{e}.up_proj.weight"]])
               for e in range(4)]
    stacked[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
    stacked[f"{prefix}.down_proj"] = torch.stack([dense[f"{prefix}.{e}.down_proj.weight"] for e in range(4)])
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del stacked[f"{prefix}.{e}.{proj}.weight"]
    src = tmp_path / "stacked"
    src.mkdir()
    save_file(stacked, str(src / "model.safetensors"))
    (src / "config.json").write_text((open(os.path.join(tiny_qwen3_moe_dir, "config.json")).read()))
    out = write_quantized_checkpoint(str(src), str(tmp_path / "q"), "gptq", 4, 64)
    _check_exact(out, dense, expect_modules=7 + 4 + 12)


def test_side_config_files_and_bf16_scales(tiny_llama_dir, tmp_path):
    out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path / "g"), "gptq", 4, 128, True,
                                     config_file="quantize_config.json", scale_dtype=torch.bfloat16)
    cfg, state = _load(out)
    assert cfg.source == "quantize_config.json" and state["model.layers.0.mlp.up_proj.scales"].dtype == torch.bfloat16
    _check_exact(out, read_state_dict(tiny_llama_dir), expect_modules=14)
    out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path / "a"), "awq", 4, 64, config_file="quant_config.json")
    assert _load(out)[0].source == "quant_config.json"
    _check_exact(out, read_state_dict(tiny_llama_dir), expect_modules=14)


def test_gptq_v2_and_v1_zero_of_zero(tmp_path, tiny_llama_dir):
    """gptq_v2 stores zeros as they are; v1's minus one borrows across a word when a zero is 0 and must read back."""
    out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path / "v2"), "gptq", 4, 32, symmetric=False,
                                     checkpoint_format="gptq_v2")
    assert _load(out)[0].checkpoint_format == "gptq_v2"
    _check_exact(out, read_state_dict(tiny_llama_dir), expect_modules=14)
    cfg = resolve_quantization({"quant_method": "gptq", "bits": 4, "group_size": 8, "sym": False}, None)
    zeros = torch.tensor([[0, 5, 0, 15, 1, 0, 7, 0]], dtype=torch.int64)  # one group, N = 8
    word = int((zeros[0] << (4 * torch.arange(8))).sum()) - 0x11111111  # GPTQModel's v2 -> v1
    qzeros = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    parts = {"qweight": torch.zeros(1, 8, dtype=torch.int32), "scales": torch.ones(1, 8, dtype=torch.float16),
             "qzeros": qzeros}
    out = dict(convert_weights(cfg, [(f"m.{k}", v) for k, v in parts.items()]))
    assert out["m.qzeros"][:, 0].tolist() == zeros[0].tolist()


def test_unquantized_modules_pass_through_and_ignore_lists(tiny_llama_dir, tmp_path):
    skip = ("model.layers.0.mlp.down_proj",)
    for method in ("awq", "compressed-tensors"):
        out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path / method), method, 4, 64, skip_modules=skip)
        cfg, state = _load(out)
        from tokenmill.quantization import is_ignored

        assert is_ignored(cfg, skip[0]) and not is_ignored(cfg, "model.layers.1.mlp.down_proj")
        assert skip[0] not in quantized_modules(cfg, state)
        converted = dict(convert_weights(cfg, state.items()))
        assert torch.equal(converted[f"{skip[0]}.weight"], read_state_dict(tiny_llama_dir)[f"{skip[0]}.weight"])


@pytest.mark.parametrize("method, bits, group_size, act_order, shape", [
    ("gptq", 4, 32, False, (24, 100)),  # K = 100: the last packed row is partly filled; N = 24: zeros too
    ("gptq", 8, 32, True, (20, 90)),
    ("gptq", 4, -1, False, (12, 36)),
    ("compressed-tensors", 4, -1, False, (20, 100)),  # the zero points' packing along N ends mid-word
    ("compressed-tensors", 8, -1, False, (6, 30)),
    ("awq", 4, 32, False, (24, 96)),
])
def test_odd_shapes_convert_exactly(tmp_path, method, bits, group_size, act_order, shape):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    dense = {"m.x_proj.weight": torch.randn(shape), "m.norm.weight": torch.randn(shape[1])}
    tensors, qcfg = quantize_state_dict(dense, method, bits, group_size, act_order, symmetric=False)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
    _check_exact(str(tmp_path), dense, expect_modules=1)
