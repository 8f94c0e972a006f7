"""Read GGUF (llama.cpp) weights as HF-named float tensors.

Each tensor is dequantized on the CPU with the `gguf` package's NumPy
reference (`gguf.quants.dequantize`: F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q2_K..Q6_K, ...), reshaped (GGUF lists dims fastest-first, so
the PyTorch shape is the reverse), renamed to the HF checkpoint name, and
undone from the two layout changes llama.cpp's `convert_hf_to_gguf.py`
makes: Q/K row permutation (llama arch) and Gemma's `norm + 1`.
The header is read by `gguf_file.read_gguf` (fast; skips tokenizer arrays);
the `gguf` package is imported only here, only when a GGUF file is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from tokenmill.kernels.cpu.gguf_matmul import KERNEL_BLOCKS, row_bytes
from tokenmill.model_loader.gguf_dequant import FAST_TYPES, fast_dequantize
from tokenmill.model_loader.gguf_file import read_gguf

# GGUF block tensor base name -> HF name under `model.layers.N.`
_BLOCK_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    # MoE experts stacked over the expert dim, [E, I, H] / [E, H, I] (qwen2moe/qwen3moe GGUFs)
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Per GGUF architecture overrides of _BLOCK_NAMES (Gemma has four norms per block).
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Recomputed from the config, never loaded (llama 3 rope frequency factors).
_SKIPPED = ("rope_freqs.weight",)
# llama.cpp permutes Q/K rows for these archs (convert_hf_to_gguf.py LlamaModel.permute);
# the same set transformers undoes (modeling_gguf_pytorch_utils.TENSOR_PROCESSORS).
_PERMUTED_QK_ARCHS = {"llama"}
# llama.cpp stores Gemma RMSNorm weights as w + 1 (HF keeps w and scales by 1 + w).
_NORM_PLUS_ONE_ARCHS = {"gemma", "gemma2", "gemma3"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str) -> str | None:
    """HF checkpoint name of GGUF tensor `name` (None for tensors that are skipped).

    Example: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`.

    Raises:
        ValueError: the tensor name is not known.
    """
    if name in _SKIPPED:
        return None
    m = _BLOCK_RE.match(name)
    if m:
        layer, base, kind = m.groups()
        hf = _ARCH_BLOCK_NAMES.get(arch, {}).get(base) or _BLOCK_NAMES.get(base)
        if hf is not None:
            return f"model.layers.{layer}.{hf}.{kind}"
    else:
        base, _, kind = name.rpartition(".")
        if base in _TOP_NAMES:
            return f"{_TOP_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} ({arch} architecture) has no known HF name; this GGUF is not supported.")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K permutation of `w` [n_head * head_dim, ...].

    llama.cpp regroups each head's rows from rotate-half order to
    interleaved pairs: rows `reshape(n_head, 2, head_dim/2)` are swapped to
    `(n_head, head_dim/2, 2)`. This reads them back as
    `(n_head, head_dim/2, 2)` and swaps to `(n_head, 2, head_dim/2)`.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights_iterator(gguf_file: str, hf_config, keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 CPU tensor) for every tensor of `gguf_file`.

    `hf_config` gives the head counts needed to undo the Q/K permutation.
    `keep_blocks`: each 2-D tensor of a `KERNEL_BLOCKS` type also carries its
    raw rows as `.gguf_blocks` (`gguf_quantized.GGUFBlocks`, rows permuted as the floats).

    Raises:
        ValueError: a tensor name or quantization type is not supported.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    gf = read_gguf(gguf_file)
    arch = gf.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{gguf_file} has no general.architecture field.")  # noqa: TRY004 (a bad file, not a bad type)
    n_head = hf_config.num_attention_heads
    n_kv_head = getattr(hf_config, "num_key_value_heads", None) or n_head
    for tensor in gf.tensors:
        hf_name = gguf_to_hf_name(tensor.name, arch)
        if hf_name is None:
            continue
        qtype = GGMLQuantizationType(tensor.ggml_type)
        w = fast_dequantize(gf.tensor_data(tensor), qtype.name) if qtype.name in FAST_TYPES else None
        if w is None:
            try:
                deq = dequantize(gf.tensor_data(tensor), qtype)
            except NotImplementedError as e:
                raise ValueError(f"GGUF tensor {tensor.name} uses quantization {qtype.name}, "
                                 f"which the gguf package cannot dequantize: {e}") from e
            # np.array copies: unquantized tensors are read-only views of the memory-mapped file.
            w = np.array(deq, dtype=np.float32)
        w = w.reshape(tensor.shape)
        raw = None
        if keep_blocks and qtype.name in KERNEL_BLOCKS and w.ndim == 2:
            # np.array copies the rows out of the memory-mapped file
            raw = np.array(gf.tensor_data(tensor), dtype=np.uint8)
            raw = raw.reshape(w.shape[0], row_bytes(qtype.name, w.shape[1]))
        if arch in _PERMUTED_QK_ARCHS:
            heads = n_head if ".attn_q." in tensor.name else n_kv_head if ".attn_k." in tensor.name else None
            if heads is not None:
                w = unpermute_qk(w, heads)
                raw = None if raw is None else unpermute_qk(raw, heads)  # a row permutation: rows are whole blocks
        if arch in _NORM_PLUS_ONE_ARCHS and "norm.weight" in tensor.name:
            w = w - 1.0
        t = torch.from_numpy(np.ascontiguousarray(w))
        if raw is not None:
            from tokenmill.model_loader.gguf_quantized import GGUFBlocks

            t.gguf_blocks = GGUFBlocks(qtype.name, torch.from_numpy(np.ascontiguousarray(raw)))
        yield hf_name, t

