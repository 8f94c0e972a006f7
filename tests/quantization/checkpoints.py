"""Writers of real-format quantized checkpoints (AWQ, GPTQ, compressed-tensors) and their reference dequantization.

`write_quantized_checkpoint` takes an HF folder of a dense model (e.g. a tiny
random Llama / Qwen3 / Qwen3-MoE from `save_tiny_hf_model`), quantizes its
linear projections round-to-nearest and writes them in the format's
published layout with the config the real tool writes:

- awq: AutoAWQ's GEMM layout (qweight [K, N/8] and qzeros [K/G, N/8] with the
  interleaved nibble order [0, 2, 4, 6, 1, 3, 5, 7], scales [K/G, N]),
  packed by this file (byte-identical to AutoAWQ's `WQLinear_GEMM.from_linear`, tested);
- gptq: GPTQModel / AutoGPTQ's layout (qweight [K/p, N], qzeros [ngroups,
  N/p] minus one for `checkpoint_format: gptq`, scales, g_idx), packed by
  this file (byte-identical to AutoGPTQ 0.7.1's `QuantLinear.pack`, checked
  once outside the suite: see references.py);
- compressed-tensors: `pack-quantized`, packed by compressed-tensors' own
  `pack_to_int32`.

Quantized: every 2-D `*_proj.weight` (attention, MLP and per-expert MoE
projections). Left as they are, like the real tools do: embeddings,
`lm_head`, norms and the MoE router `mlp.gate`. Stacked experts
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) are
written per expert (`experts.3.gate_proj...`), as real AWQ/GPTQ MoE
checkpoints are.

`quantize_state_dict` does the same for a dense state dict in memory
(returning the tensors and the config dict).

`reference_dequantized_state_dict` (tests/quantization/references.py,
re-exported here) reads such a folder back into dense weights with the
reference libraries' own code.

Tests next to this file import it as `checkpoints`; tests elsewhere as
`tests.quantization.checkpoints` (the repository root is on pytest's
pythonpath; a dependency that installs a top-level `tests` package, as
AutoGPTQ's wheel does, would shadow that name).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

try:  # imported as tests.quantization.checkpoints (from another test folder)
    from .references import read_state_dict, reference_dequantized_state_dict
except ImportError:  # imported as `checkpoints` by the tests next to it
    from references import read_state_dict, reference_dequantized_state_dict

__all__ = ["is_quantized_by_tools", "quantize_state_dict", "read_state_dict", "reference_dequantized_state_dict",
           "save_tiny_hf_model", "write_quantized_checkpoint"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
DEFAULT_SYMMETRIC = {"awq": False, "gptq": True, "compressed-tensors": True}


# ---- tiny dense models --------------------------------------------------------------------------

TINY = {
    # hidden 128 and intermediate 256 so group sizes 32 / 64 / 128 divide every K.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=256)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=256, head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], head_dim=32)),
}


def save_tiny_hf_model(kind: str, folder: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """Write a tiny random HF model ("llama" | "qwen3" | "qwen3_moe"; hidden 128, 2 layers, vocab 160) to `folder`."""
    import transformers

    config_cls, model_cls, overrides = TINY[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(
        vocab_size=160, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, tie_word_embeddings=False, **overrides)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    model.save_pretrained(folder)
    return folder


# ---- reading a dense folder ---------------------------------------------------------------------

def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split HF 5's stacked experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])."""
    out = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj") and t.dim() == 3:
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith(".experts.down_proj") and t.dim() == 3:
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def is_quantized_by_tools(name: str, t: torch.Tensor) -> bool:
    """The weights AWQ / GPTQ / llm-compressor quantize: 2-D `*_proj.weight` (not embeddings, lm_head, norms,
    the MoE router `mlp.gate`)."""
    if not name.endswith(".weight") or t.dim() != 2:
        return False
    return name[: -len(".weight")].rsplit(".", 1)[-1].endswith("_proj")


# ---- round-to-nearest ---------------------------------------------------------------------------

def _rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool, perm: torch.Tensor | None,
         scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize W [N, K]; groups run over the columns in `perm` order (act-order) or in order.

    Returns q uint8 [N, K] (unsigned), scales [N, ngroups] in scale_dtype, zeros uint8 [N, ngroups]
    (the midpoint when symmetric) and g_idx int32 [K].
    """
    n, k = w.shape
    g = k if group_size == -1 else group_size
    ngroups = -(-k // g)
    order = torch.arange(k) if perm is None else perm
    wp = torch.nn.functional.pad(w.float()[:, order], (0, ngroups * g - k)).reshape(n, ngroups, g)
    valid = torch.nn.functional.pad(torch.ones(k, dtype=torch.bool), (0, ngroups * g - k)).reshape(ngroups, g)
    qmax = (1 << bits) - 1
    big = torch.finfo(torch.float32).max
    if symmetric:
        absmax = torch.where(valid, wp.abs(), 0).amax(-1)
        scale = (absmax / ((1 << (bits - 1)) - 1)).clamp_min(1e-6).to(scale_dtype).float()
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo = torch.where(valid, wp, big).amin(-1).clamp_max(0)
        hi = torch.where(valid, wp, -big).amax(-1).clamp_min(0)
        scale = ((hi - lo) / qmax).clamp_min(1e-6).to(scale_dtype).float()
        zero = torch.round(-lo / scale).clamp(0, qmax)
    qp = torch.round(wp / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, qmax).reshape(n, ngroups * g)[:, :k]
    q = torch.empty(n, k, dtype=torch.uint8)
    q[:, order] = qp.to(torch.uint8)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    return q, scale.to(scale_dtype), zero.to(torch.uint8), g_idx


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned values [R, C] along the last dim, low bits first (GPTQ's packer): int32 [R, ceil(C / p)]."""
    p = 32 // bits
    c = v.shape[1]
    v = torch.nn.functional.pad(v.to(torch.int64), (0, -(-c // p) * p - c)).reshape(v.shape[0], -1, p)
    words = (v << (torch.arange(p) * bits)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _awq_pack(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit [R, C] (C % 8 == 0) -> AWQ words [R, C / 8]: nibble i of word j holds column 8j + AWQ_ORDER[i]."""
    idx = (torch.arange(v.shape[1] // 8).unsqueeze(-1) * 8 + torch.tensor(AWQ_ORDER)).reshape(-1)
    return _pack_rows(v[:, idx], 4)


# ---- per-format module writers ------------------------------------------------------------------

def _write_awq(w, bits, group_size, symmetric, perm, scale_dtype):
    n, k = w.shape
    if bits != 4 or perm is not None:
        raise ValueError("AWQ checkpoints are 4-bit without act-order.")
    if n % 8 or (group_size != -1 and k % group_size):
        raise ValueError(f"AWQ's layout needs N % 8 == 0 and K % group_size == 0 (W is {n} x {k}).")
    q, s, z, _ = _rtn(w, bits, group_size, symmetric, None, scale_dtype)
    # AutoAWQ's GEMM export always stores zeros; a symmetric one stores the midpoint 8.
    return {"qweight": _awq_pack(q.t()), "qzeros": _awq_pack(z.t()), "scales": s.t().contiguous()}


def _write_gptq(w, bits, group_size, symmetric, perm, scale_dtype, checkpoint_format):
    q, s, z, g_idx = _rtn(w, bits, group_size, symmetric, perm, scale_dtype)
    qzeros = _pack_rows(z.t(), bits)  # [ngroups, N / p]
    if checkpoint_format == "gptq":  # v1 stores zero - 1: GPTQModel subtracts 0x11111111 per word
        one_each = sum(1 << (bits * j) for j in range(32 // bits))
        words = (qzeros.to(torch.int64) - one_each) & 0xFFFFFFFF
        qzeros = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return {"qweight": _pack_rows(q, bits).t().contiguous(), "qzeros": qzeros, "scales": s.t().contiguous(),
            "g_idx": g_idx}


def _write_compressed_tensors(w, bits, group_size, symmetric, perm, scale_dtype):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q, s, z, g_idx = _rtn(w, bits, group_size, symmetric, perm, scale_dtype)
    mid = 1 << (bits - 1)
    out = {"weight_packed": pack_to_int32((q.to(torch.int16) - mid).to(torch.int8), bits),
           "weight_scale": s, "weight_shape": torch.tensor(list(w.shape))}
    if not symmetric:
        out["weight_zero_point"] = pack_to_int32((z.to(torch.int16) - mid).to(torch.int8), bits, packed_dim=0)
    if perm is not None:
        out["weight_g_idx"] = g_idx
    return out


def _quantization_config(method, bits, group_size, symmetric, act_order, checkpoint_format, ignore):
    """The config the real tool writes (AutoAWQ, GPTQModel, llm-compressor), field for field."""
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": not symmetric,
                "version": "gemm", "modules_to_not_convert": ignore or None}
    if method == "gptq":
        return {"bits": bits, "group_size": group_size, "desc_act": act_order, "sym": symmetric, "lm_head": False,
                "quant_method": "gptq", "checkpoint_format": checkpoint_format, "pack_dtype": "int32",
                "meta": {"quantizer": ["gptqmodel:4.0.0"], "uri": "https://github.com/modelcloud/gptqmodel",
                         "damp_percent": 0.05, "damp_auto_increment": 0.01, "static_groups": False,
                         "true_sequential": True, "mse": 0.0}}
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "observer": "minmax"}
    if act_order:
        weights["actorder"] = "group"
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head", "re:.*mlp.gate$"] + list(ignore), "quantization_status": "compressed",
            "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
            "version": "0.12.0"}


def quantize_state_dict(state: dict[str, torch.Tensor], method: str, bits: int, group_size: int,
                        act_order: bool = False, symmetric: bool | None = None, *,
                        scale_dtype: torch.dtype = torch.float16, checkpoint_format: str = "gptq",
                        skip_modules: tuple[str, ...] = (), seed: int = 0,
                        ) -> tuple[dict[str, torch.Tensor], dict]:
    """A dense state dict in `method`'s checkpoint format: (tensors, the quantization_config dict the tool writes).

    Arguments as `write_quantized_checkpoint`. 2-D `*_proj.weight` tensors
    (`is_quantized_by_tools`) not in `skip_modules` become the format's
    tensors; stacked experts are split per expert; the rest is kept.

    Raises:
        ValueError: a shape the format cannot store (AWQ: N % 8, K % group_size).
    """
    symmetric = DEFAULT_SYMMETRIC[method] if symmetric is None else symmetric
    gen = torch.Generator().manual_seed(seed)
    out = {}
    # GPTQ orders a layer's columns by its input's Hessian, so the layers reading one input (q/k/v, gate/up;
    # an expert's gate/up) get one permutation: drawn once per (module's parent, input width).
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for name, t in _per_expert(state).items():
        module = name[: -len(".weight")]
        if not is_quantized_by_tools(name, t) or module in skip_modules:
            out[name] = t
            continue
        perm = None
        if act_order:
            key = (module.rsplit(".", 1)[0], t.shape[1])
            if key not in perms:
                perms[key] = torch.randperm(t.shape[1], generator=gen)
            perm = perms[key]
        if method == "awq":
            parts = _write_awq(t, bits, group_size, symmetric, perm, scale_dtype)
        elif method == "gptq":
            parts = _write_gptq(t, bits, group_size, symmetric, perm, scale_dtype, checkpoint_format)
        elif method == "compressed-tensors":
            parts = _write_compressed_tensors(t, bits, group_size, symmetric, perm, scale_dtype)
        else:
            raise ValueError(f"unknown method {method!r}")
        out.update({f"{module}.{suffix}": v for suffix, v in parts.items()})
    qcfg = _quantization_config(method, bits, group_size, symmetric, act_order, checkpoint_format, list(skip_modules))
    return out, qcfg


def write_quantized_checkpoint(model_dir_in: str, out_dir: str, method: str, bits: int, group_size: int,
                               act_order: bool = False, symmetric: bool | None = None, *,
                               scale_dtype: torch.dtype = torch.float16, checkpoint_format: str = "gptq",
                               config_file: str = "config.json", skip_modules: tuple[str, ...] = (),
                               seed: int = 0) -> str:
    """Write `model_dir_in`'s dense weights as a quantized checkpoint in `method`'s published format.

    Args:
        model_dir_in: HF folder (config.json + *.safetensors) of a dense model.
        out_dir: folder to write (created); other files (tokenizer, ...) are copied.
        method: "awq" | "gptq" | "compressed-tensors".
        bits: 4 (awq) or 4 / 8.
        group_size: 32, 64, 128, ... or -1 (one group per output channel;
            compressed-tensors' channel strategy).
        act_order: GPTQ desc_act / compressed-tensors actorder "group": a
            random column order per module (seeded) forms the groups; g_idx stored.
        symmetric: default per method (AWQ zero_point true; GPTQ sym true;
            compressed-tensors symmetric true).
        scale_dtype: dtype of the stored scales (the tools write float16 / the model's dtype).
        checkpoint_format: GPTQ only: "gptq" (zeros minus one) or "gptq_v2".
        config_file: "config.json" (quantization_config inside it), or
            "quantize_config.json" / "quant_config.json" (AWQ / GPTQ's side file).
        skip_modules: module paths left unquantized and listed in the
            config's ignore list (AWQ modules_to_not_convert / CT ignore).
        seed: seeds the act-order permutations.

    Returns:
        out_dir.
    """
    os.makedirs(out_dir, exist_ok=True)
    for entry in os.listdir(model_dir_in):
        src = os.path.join(model_dir_in, entry)
        if os.path.isfile(src) and not entry.endswith(".safetensors") and entry not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(src, os.path.join(out_dir, entry))
    out, qcfg = quantize_state_dict(read_state_dict(model_dir_in), method, bits, group_size, act_order, symmetric,
                                    scale_dtype=scale_dtype, checkpoint_format=checkpoint_format,
                                    skip_modules=skip_modules, seed=seed)
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(model_dir_in, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if config_file == "config.json":
        config["quantization_config"] = qcfg
    else:
        with open(os.path.join(out_dir, config_file), "w", encoding="utf-8") as f:
            json.dump(qcfg, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return out_dir
