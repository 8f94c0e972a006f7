"""Real GGUF files with their weights kept quantized on the CPU vs dequantized at load (TOKENMILL_CPU_GGUF_KERNELS).

The bundled SmolLM2 (Q4_1 layers, Q8_0 tied embedding/LM head) and, when its
package is installed, Gemma 3 270M (Q4_K_M: Q4_K, Q6_K and more): every
quantized weight must dequantize to the float model's weight bit for bit,
and the logits of a short prompt (the C kernel: <= KERNEL_MAX_TOKENS tokens)
and a long one (dequantize + BLAS) must match the float model's.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.layers.gguf_weights import KERNEL_MAX_TOKENS, GGUFWeight
from tokenmill.layers.linear import LinearBase
from tokenmill.model_loader import get_model

pytestmark = pytest.mark.slow  # two real models per file (~10-30 s on 2 cores)


def _pair(gguf: str, monkeypatch) -> tuple[torch.nn.Module, torch.nn.Module]:
    return _kept_quantized(gguf, monkeypatch), _dequantized(gguf, monkeypatch)


def _kept_quantized(gguf: str, monkeypatch) -> torch.nn.Module:
    cfg = EngineArgs(model=gguf, device="cpu", dtype="float32").create_engine_config()
    monkeypatch.setenv("TOKENMILL_CPU_GGUF_KERNELS", "1")
    return get_model(cfg.model_config, "cpu", "float32")


def _dequantized(gguf: str, monkeypatch) -> torch.nn.Module:
    cfg = EngineArgs(model=gguf, device="cpu", dtype="float32").create_engine_config()
    monkeypatch.setenv("TOKENMILL_CPU_GGUF_KERNELS", "0")
    return get_model(cfg.model_config, "cpu", "float32")


def _check(quant, plain, run_prompt, vocab: int, expect_layers: int) -> None:
    linears = {n: m for n, m in quant.named_modules() if isinstance(m, LinearBase)}
    plain_modules = dict(plain.named_modules())
    kept = [n for n, m in linears.items() if isinstance(m.weight, GGUFWeight)]
    assert len(kept) == expect_layers
    for name in kept:
        assert torch.equal(linears[name].weight.dequantize(), plain_modules[name].weight), name
    assert quant.lm_head.gguf_weight is not None
    assert torch.equal(quant.lm_head.gguf_weight.dequantize(), plain.lm_head.weight)
    for length in (KERNEL_MAX_TOKENS - 2, 3 * KERNEL_MAX_TOKENS):
        ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        got, want = run_prompt(quant, ids), run_prompt(plain, ids)
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4, length
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_smollm2_q4_1(smollm2_gguf, monkeypatch, run_tokenmill_prompt):
    quant, plain = _pair(smollm2_gguf, monkeypatch)
    _check(quant, plain, run_tokenmill_prompt, 49152, expect_layers=30 * 4)  # qkv, o, gate_up, down


def test_gemma3_q4_k_m(gemma3_gguf, gemma3_llm, monkeypatch, run_tokenmill_prompt):
    # The kept-quantized model is the shared float32 LLM's (conftest.py), loaded once for two files.
    quant = gemma3_llm.llm_engine.engine_core.executor.worker.model_runner.model
    plain = _dequantized(gemma3_gguf, monkeypatch)
    types = {seg.qtype for m in quant.modules() if isinstance(m, LinearBase) and isinstance(m.weight, GGUFWeight)
             for seg in m.weight.segments}
    assert {"Q4_K", "Q6_K"} <= types  # both K-quant kernels ran on the real file
    _check(quant, plain, run_tokenmill_prompt, 262144, expect_layers=sum(
        isinstance(m, LinearBase) for m in plain.modules()))
