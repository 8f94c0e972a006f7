"""The one-call CPU decode step (`models/cpu_fused_decode.py`, `kernels/cpu/decoder_step.c`) vs the module path.

Both run the same C kernels on the same inputs, so a decode step's logits must
be the module path's bits (torch.equal), through a paged KV cache written by
the fused path and read back by later steps. A tiny random Llama GGUF covers
mixed block types (q|k|v of two types, Q4_0/Q4_1/Q8_0) and a head size the
attention kernel does not specialize; the bundled SmolLM2 Q4_1 is the real
file, also checked against the float model dequantized at load within the
GGUF tests' tolerance (1e-4 of the largest logit, same argmax). Steps the
fused path must leave alone (two tokens, the switch off) are checked to run
the modules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.forward_context import set_forward_context
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.config import EngineArgs
from tokenmill.kernels.cpu import build as cpu_build
from tokenmill.kernels.cpu import decoder_step
from tokenmill.model_loader import get_model
from tokenmill.models import cpu_fused_decode

BLOCK = 4  # cache block size: decodes cross block boundaries


def _metadata(start: int, n: int, num_blocks: int) -> AttentionMetadata:
    """One request whose tokens [start, start + n) are new, cached in blocks num_blocks - 1, num_blocks - 2, ...
    (a reversed block table, so a kernel reading the wrong block would show)."""
    table = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32)[None]
    pos = torch.arange(start, start + n)
    slots = table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK
    qsl, seq = np.array([0, n], dtype=np.int32), np.array([start + n], dtype=np.int32)
    return AttentionMetadata(n, 1, n, start + n, torch.from_numpy(qsl), torch.from_numpy(seq), table, slots, qsl, seq)


@torch.no_grad()
def _decode_logits(model, token_ids: list[int], prefill: int) -> list[torch.Tensor]:
    """Logits [vocab] of each token after the first `prefill` (prefilled in one step), one decode step each."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_blocks = -(-len(token_ids) // BLOCK) + 1
    caches = [torch.zeros(2, num_blocks, BLOCK, cfg.num_key_value_heads, head_dim)
              for _ in range(cfg.num_hidden_layers)]
    backend = TorchSDPABackend()
    out = []
    for start, n in [(0, prefill)] + [(i, 1) for i in range(prefill, len(token_ids))]:
        ids = torch.tensor(token_ids[start:start + n])
        with set_forward_context(_metadata(start, n, num_blocks), caches, backend):
            hidden = model(ids, torch.arange(start, start + n))
        if n == 1:
            out.append(model.compute_logits(hidden)[0])
    return out


def _count_runs(monkeypatch) -> list[int]:
    calls = []
    real = decoder_step.DecoderStepPlan.run
    monkeypatch.setattr(decoder_step.DecoderStepPlan, "run", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def _fused_vs_modules(model, token_ids, prefill, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    calls = _count_runs(monkeypatch)
    fused = _decode_logits(model, token_ids, prefill)
    assert len(calls) == len(token_ids) - prefill  # every decode step took the fused path
    assert isinstance(model.model.__dict__["_cpu_fused_decode_plan"], decoder_step.DecoderStepPlan)
    monkeypatch.setenv("TOKENMILL_CPU_FUSED_DECODE", "0")
    model.model.__dict__.pop("_cpu_fused_decode_plan")  # the plan is built once per model: build it again
    modules = _decode_logits(model, token_ids, prefill)
    assert len(calls) == len(token_ids) - prefill  # the switch turned it off
    assert model.model.__dict__["_cpu_fused_decode_plan"] is False
    monkeypatch.delenv("TOKENMILL_CPU_FUSED_DECODE")
    model.model.__dict__.pop("_cpu_fused_decode_plan")
    return fused, modules


def _write_tiny_gguf(path: str, types: dict[str, str]) -> None:
    """A random 2-layer Llama GGUF (hidden 128, 4 heads of 32, 2 KV heads) with linear types `types`."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, inter, layers, vocab = 128, 256, 2, 320
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (64, hidden), "attn_v": (64, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    head = gguf.quants.quantize(0.1 * rng.standard_normal((vocab, hidden)).astype(np.float32), q8)
    w.add_tensor("output.weight", head, raw_shape=head.shape, raw_dtype=q8)
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for name, shape in shapes.items():
            qtype = gguf.GGMLQuantizationType[types[name]]
            data = gguf.quants.quantize((rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32), qtype)
            w.add_tensor(f"blk.{i}.{name}.weight", data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def lib(require_cpu_kernel):
    return require_cpu_kernel(decoder_step.load, decoder_step._SOURCE)


def _load(path: str, dtype: str = "float32"):
    cfg = EngineArgs(model=path, device="cpu", dtype=dtype).create_engine_config()
    return get_model(cfg.model_config, "cpu", dtype)


@pytest.mark.parametrize("types", [
    dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_1"),
    {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1",
     "ffn_up": "Q4_0", "ffn_down": "Q4_1"},
], ids=["q4_1", "mixed"])
def test_tiny_gguf_fused_decode_is_the_module_path(tmp_path, monkeypatch, types, lib):
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, types)
    model = _load(path)
    token_ids = torch.randint(0, 320, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    fused, modules = _fused_vs_modules(model, token_ids, 5, monkeypatch)
    for got, want in zip(fused, modules, strict=True):
        assert torch.isfinite(want).all()
        assert torch.equal(got, want)


def test_tiny_gguf_plain_c_fused_decode_is_the_module_path(plain_c_kernels, tmp_path, monkeypatch):
    """Built without AVX-512 (x86-64-v3): the included kernels' plain-C loops, still the module path's bits."""
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_0",
                            "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0"})
    model = _load(path)
    token_ids = torch.randint(0, 320, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    fused, modules = _fused_vs_modules(model, token_ids, 3, monkeypatch)
    for got, want in zip(fused, modules, strict=True):
        assert torch.equal(got, want)


def test_build_hashes_the_included_kernel_sources():
    """decoder_step.c includes the other kernels' sources: editing one of them must rebuild it."""
    names = [p.name for p in cpu_build._local_sources(decoder_step._SOURCE)]
    assert names == ["decoder_step.c", "elementwise.c", "gguf_matmul.c", "decode_attention.c"]
    assert [p.name for p in cpu_build._local_sources(cpu_build.INCLUDE_DIR / "gguf_matmul.c")] == ["gguf_matmul.c"]


def test_tiny_gguf_two_tokens_and_bfloat16_keep_the_modules(tmp_path, monkeypatch, lib):
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                          "ffn_down"), "Q4_1"))
    calls = _count_runs(monkeypatch)
    model = _load(path)
    caches = [torch.zeros(2, 4, BLOCK, 2, 32) for _ in range(2)]
    with set_forward_context(_metadata(0, 2, 4), caches, TorchSDPABackend()):
        model(torch.tensor([3, 4]), torch.arange(2))  # a 2-token step
    assert calls == [] and "_cpu_fused_decode_plan" not in model.model.__dict__
    bf16 = _load(path, "bfloat16")
    assert cpu_fused_decode.build_plan(bf16.model) is None  # bfloat16 norms: the module path
    assert cpu_fused_decode.build_plan(model.model) is not None
    monkeypatch.setenv("TOKENMILL_CPU_GGUF_KERNELS", "0")  # weights dequantized at load: not GGUF blocks
    assert cpu_fused_decode.build_plan(_load(path).model) is None


@pytest.mark.slow
def test_smollm2_q4_1_fused_decode(smollm2_gguf, monkeypatch, lib):
    model = _load(smollm2_gguf)
    token_ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    fused, modules = _fused_vs_modules(model, token_ids, 16, monkeypatch)
    for got, want in zip(fused, modules, strict=True):
        assert torch.equal(got, want)
    monkeypatch.setenv("TOKENMILL_CPU_GGUF_KERNELS", "0")
    plain = _decode_logits(_load(smollm2_gguf), token_ids, 16)  # dequantized at load, module path
    for got, want in zip(fused, plain, strict=True):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
        assert torch.equal(got.argmax(), want.argmax())
