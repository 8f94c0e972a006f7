"""A tiny Llama written to GGUF the way llama.cpp's converter does (Q/K rows permuted, Q8_0/F16/F32
tensors), loaded through resolve_engine_config + get_model, vs transformers on the same (dequantized) weights."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from tokenmill.config import EngineArgs
from tokenmill.model_loader import get_model

N_HEAD, N_KV_HEAD, HIDDEN, VOCAB = 4, 2, 64, 256


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's Q/K reordering: each head's two halves are interleaved pairwise.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: str, hf: HFLlamaForCausalLM) -> None:
    """Write `hf` as GGUF; replace its weights by what the file holds after quantization."""
    import gguf

    q = gguf.GGMLQuantizationType
    cfg = hf.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV_HEAD)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    names = {"model.embed_tokens.weight": ("token_embd.weight", q.F32), "model.norm.weight": ("output_norm.weight", q.F32),
             "lm_head.weight": ("output.weight", q.Q8_0)}
    per_layer = {"self_attn.q_proj": ("attn_q", q.Q8_0), "self_attn.k_proj": ("attn_k", q.Q8_0),
                 "self_attn.v_proj": ("attn_v", q.F16), "self_attn.o_proj": ("attn_output", q.Q8_0),
                 "mlp.gate_proj": ("ffn_gate", q.Q8_0), "mlp.up_proj": ("ffn_up", q.F16),
                 "mlp.down_proj": ("ffn_down", q.Q8_0), "input_layernorm": ("attn_norm", q.F32),
                 "post_attention_layernorm": ("ffn_norm", q.F32)}
    for i in range(cfg.num_hidden_layers):
        for hf_part, (gguf_part, qtype) in per_layer.items():
            names[f"model.layers.{i}.{hf_part}.weight"] = (f"blk.{i}.{gguf_part}.weight", qtype)
    state = hf.state_dict()
    for hf_name, (gguf_name, qtype) in names.items():
        x = state[hf_name].numpy().astype(np.float32)
        if ".attn_q." in gguf_name:
            x = _llama_cpp_permute(x, N_HEAD)
        elif ".attn_k." in gguf_name:
            x = _llama_cpp_permute(x, N_KV_HEAD)
        if qtype == q.F32:
            w.add_tensor(gguf_name, x)
            continue
        if qtype == q.F16:
            data = x.astype(np.float16)
            w.add_tensor(gguf_name, data)
            stored = data.astype(np.float32)
        else:
            data = gguf.quants.quantize(x, qtype)
            w.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
            stored = gguf.quants.dequantize(data, qtype)
        if ".attn_q." in gguf_name or ".attn_k." in gguf_name:  # back to HF order for the reference
            n = N_HEAD if ".attn_q." in gguf_name else N_KV_HEAD
            half = stored.shape[0] // n // 2
            stored = stored.reshape(n, half, 2, *stored.shape[1:]).swapaxes(1, 2).reshape(stored.shape)
        state[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(stored)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_matches_transformers(tmp_path, monkeypatch, run_tokenmill_prompt):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    hf = HFLlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV_HEAD, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        path = str(tmp_path / "tiny.gguf")
        _write_gguf(path, hf)
    cfg = EngineArgs(model=path, device="cpu").create_engine_config()
    assert cfg.model_config.gguf_file == path and cfg.model_config.hf_config.num_key_value_heads == N_KV_HEAD
    ours = get_model(cfg.model_config, "cpu", cfg.model_config.dtype)
    token_ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    logits = run_tokenmill_prompt(ours, token_ids)
    assert ((logits - ref).abs().max() / ref.abs().max()).item() <= 1e-4
