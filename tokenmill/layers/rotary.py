"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer").

Neox style (HF Llama's `rotate_half`): a head vector's first half pairs with
its second half, `x1 = x[:d/2], x2 = x[d/2:]`, and position p rotates pair i
by angle `p * inv_freq[i]`, `inv_freq[i] = theta ** (-2i / d)`:

    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]

The GPT-J style (`is_neox_style=False`) pairs adjacent dims (0,1), (2,3), ...
Frequency scalings follow transformers' `modeling_rope_utils.py`:
"default", "linear" (inv_freq / factor), "llama3" (Llama-3.1: long
wavelengths divided by `factor`, short ones kept, a smooth blend between)
and "yarn" (Peng et al. 2023, arXiv:2309.00071: the same blend over a
linear ramp of dims between the `beta_fast` and `beta_slow` rotation counts,
plus an attention factor, default 0.1 ln(factor) + 1, multiplied into cos
and sin, so q.k scales by its square; gpt-oss).

On CUDA, forward is one fused Triton kernel for q and k (tokenmill/kernels/
triton/rotary.py, bit-identical); `forward_torch` is the reference.
On CPU, neox style with the whole head rotating takes `forward_cpu`: the
same roundings in 6 ATen calls for q and k together instead of 18, from a
[cos | cos] / [-sin | sin] table:

    out = x * [cos | cos] + [x2 | x1] * [-sin | sin]
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters_from_config(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of a HF config as one dict with `rope_theta` and `rope_type`.

    Reads transformers 5's `config.rope_parameters` (a dict, or a dict of
    dicts keyed by layer type such as "full_attention"/"sliding_attention"
    for Gemma 3; pick one with `layer_type`) or the older `rope_theta` +
    `rope_scaling` attributes (`rope_scaling["type"]` accepted as
    `rope_type`). Missing theta defaults to 10000 (HF's default).
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        elif "rope_theta" not in params and "rope_type" not in params:
            # Keyed by layer type but none asked for: take the full-attention one.
            params = params.get("full_attention") or next(iter(params.values()))
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(config, "rope_theta", None) or out.get("rope_theta", 10000.0)
    out.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = rope_type
    return out


def compute_inv_freq(rotary_dim: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    """inv_freq [rotary_dim // 2] float32 for the given RoPE parameters.

    Raises:
        ValueError: an unsupported `rope_type`.
    """
    base = float(rope_parameters["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_parameters["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_parameters)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, rope_parameters)
    raise ValueError(f"RoPE type {rope_type!r} is not supported; supported types: {', '.join(SUPPORTED_ROPE_TYPES)}.")


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Meta's Llama 3.1 reference `apply_scaling`, as in transformers' _compute_llama3_parameters.
    factor = float(p["factor"])
    low_freq_factor = float(p["low_freq_factor"])
    high_freq_factor = float(p["high_freq_factor"])
    old_context_len = float(p["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, p: dict[str, Any]) -> torch.Tensor:
    # transformers' _compute_yarn_parameters: dims whose wavelength fits more than beta_fast rotations in the
    # original context keep their frequency (extrapolation), dims with fewer than beta_slow are divided by
    # `factor` (interpolation), and a linear ramp over the dim index blends the two between.
    base, factor = float(p["rope_theta"]), float(p["factor"])
    original = float(p["original_max_position_embeddings"])
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a nonzero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1 = keep the original frequency
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope_parameters: dict[str, Any]) -> float:
    """The factor YaRN multiplies into cos and sin (1.0 for other RoPE types).

    `attention_factor` when given; else from `mscale`/`mscale_all_dim` when
    both are set, else 0.1 * ln(factor) + 1 (factor > 1), as transformers'
    `_compute_yarn_parameters`.
    """
    if rope_parameters.get("rope_type") != "yarn":
        return 1.0
    if rope_parameters.get("attention_factor") is not None:
        return float(rope_parameters["attention_factor"])
    factor = float(rope_parameters["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k (returns rotated copies).

    Args:
        head_size: size of each head.
        rotary_dim: leading dims of each head that rotate (== head_size
            unless the model uses a partial rotary factor).
        max_position: positions the cos/sin cache covers (positions must be < it).
        rope_parameters: as returned by `rope_parameters_from_config`.
        is_neox_style: rotate halves (True, Llama) or adjacent pairs (False).

    forward(positions [T] int64, query [T, nh * head_size], key [T, nkv * head_size])
    -> (query, key) of the same shapes and dtype.
    On CUDA one fused Triton launch for q and k (bit-identical; q/k may be
    row-strided views of the fused qkv output); on CPU (neox style, whole
    head rotating) one C call (`kernels.cpu.elementwise.rotary_neox`, bit-identical)
    where the kernels build, else `forward_cpu`; otherwise `forward_torch`.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, rope_parameters: dict[str, Any],
                 is_neox_style: bool = True) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv_freq = compute_inv_freq(rotary_dim, rope_parameters)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
        # Kept in float32 (cast to the activations' dtype at use, as HF does); YaRN's attention factor is
        # multiplied in before that cast, as HF does.
        scaling = rope_attention_factor(rope_parameters)
        self.register_buffer("cos_cache", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scaling, persistent=False)
        # CPU only, built at first use: [max_position, 2, head_size] float32 rows ([cos | cos], [-sin | sin]).
        self._cos_sin_full: torch.Tensor | None = None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, n, head_size]; cos, sin [T, 1, rotary_dim // 2]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = kernels.rotary_embedding(positions, query, key, self.cos_cache, self.sin_cache, self.head_size,
                                       self.rotary_dim, self.is_neox_style)
        if out is not None:
            return out
        if query.device.type == "cpu" and self.is_neox_style and self.rotary_dim == self.head_size:
            return self.forward_cpu(positions, query, key)
        return self.forward_torch(positions, query, key)

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_torch`, bit-identical, in 6 ops instead of 18 (neox style, rotary_dim == head_size).

        positions [T] int64; query [T, nh * head_size] or [T, nh, head_size],
        key likewise with nkv heads, same dtype. x1 * cos - x2 * sin is
        computed as x1 * cos + x2 * (-sin): negation is exact and rounding
        symmetric, so every intermediate rounds as in `forward_torch`.
        When key directly follows query in one buffer with the same row stride
        (the split of the fused qkv output), both rotate as one
        [T, nh + nkv, head_size] tensor and come back as row-strided views of
        one new tensor (row stride (nh + nkv) * head_size); otherwise as two
        new contiguous tensors. Either way shaped like the inputs.
        The [cos | cos], [-sin | sin] table costs 2 x max_position x
        head_size float32 (Llama 3.1: 128 MiB), built at first use.

        Raises:
            ValueError: GPT-J style or a partial rotary dim (use `forward_torch`).
        """
        if not self.is_neox_style or self.rotary_dim != self.head_size:
            raise ValueError("forward_cpu handles neox style with rotary_dim == head_size only; "
                             "use forward_torch.")
        cos, sin = self.cos_cache, self.sin_cache
        table_full = self._cos_sin_full
        if table_full is None or table_full.device != cos.device or table_full.dtype != cos.dtype:
            table_full = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)
            self._cos_sin_full = table_full
        num_tokens, d = positions.shape[0], self.head_size
        table = table_full.index_select(0, positions).to(query.dtype)  # [T, 2, d]
        cos, sin = table[:, None, 0], table[:, None, 1]  # [T, 1, d] each
        nq, nk = query.numel() // max(1, num_tokens * d), key.numel() // max(1, num_tokens * d)
        adjacent = key.data_ptr() == query.data_ptr() + query.shape[-1] * query.element_size()
        if (query.dim() == 2 and key.dim() == 2 and key.dtype == query.dtype and query.stride() == key.stride()
                and query.stride(1) == 1 and adjacent):
            x = query.as_strided((num_tokens, nq + nk, d), (query.stride(0), d, 1))
            out = self._rotate_full(x, cos, sin)
            return out[:, :nq].reshape(query.shape), out[:, nq:].reshape(key.shape)
        q = self._rotate_full(query.reshape(num_tokens, -1, d), cos, sin)
        k = self._rotate_full(key.reshape(num_tokens, -1, d), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)

    @staticmethod
    def _rotate_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, n, d]; cos = [cos | cos], sin = [-sin | sin], [T, 1, d] in x's dtype.
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        out = x * cos
        return out.add_(swapped.mul_(sin))

    def forward_torch(self, positions: torch.Tensor, query: torch.Tensor,
                      key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` in PyTorch ops: the reference of the fused CUDA kernel and of `forward_cpu`."""
        num_tokens = positions.shape[0]
        cos = self.cos_cache.index_select(0, positions).to(query.dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(query.dtype).unsqueeze(1)
        q = self._rotate(query.view(num_tokens, -1, self.head_size), cos, sin)
        k = self._rotate(key.view(num_tokens, -1, self.head_size), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_size: int, max_position: int, rope_parameters: dict[str, Any], rotary_dim: int | None = None,
             is_neox_style: bool = True) -> RotaryEmbedding:
    """A RotaryEmbedding; `rotary_dim` defaults to `head_size * partial_rotary_factor`.

    Identical requests return the same module, so all layers of a model share
    one cos/sin cache (Llama 3.1's 131072 positions would otherwise cost
    64 MiB per layer).
    """
    if rotary_dim is None:
        rotary_dim = int(head_size * float(rope_parameters.get("partial_rotary_factor", 1.0)))
    device = torch.empty(0).device  # the caller's default device (`with torch.device(...)`)
    key = (head_size, rotary_dim, max_position, is_neox_style, str(device),
           tuple(sorted((k, repr(v)) for k, v in rope_parameters.items())))
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_size, rotary_dim, max_position, rope_parameters, is_neox_style)
        _ROPE_CACHE[key] = rope
    return rope
