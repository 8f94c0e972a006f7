"""The one dtype table: names <-> torch dtypes, accepted spellings, sizes in bytes.

Model dtypes are float32, float16 and bfloat16; `--dtype` also takes vLLM's
spellings (half, float, fp16, bf16, fp32) and "auto", which each platform
resolves (`platforms/`: bfloat16 on CUDA cc >= 8.0, float16 below, float32 on
CPU). fp8 (float8_e4m3fn, and float8_e5m2 for the KV cache) appears only as a
storage dtype (KV cache, weights); `--kv-cache-dtype` names are in `KV_CACHE_DTYPES`.
"""

from __future__ import annotations

import torch

# canonical name -> torch dtype (the model dtypes, in the order messages list them)
MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# every accepted `--dtype` spelling (vLLM's) except "auto" -> torch dtype
DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

# storage dtypes by name (model dtypes plus fp8), for sizes
_STORAGE_DTYPES: dict[str, torch.dtype] = {**MODEL_DTYPES, "fp8": torch.float8_e4m3fn,
                                           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}

# `--kv-cache-dtype` (vLLM's values) -> the KV cache's storage dtype; None ("auto") = the model dtype.
# fp8 is e4m3 (OCP OFP8 E4M3, max 448), as vLLM's "fp8"; e5m2 (max 57344) trades a mantissa bit for range.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Largest finite value of each fp8 KV dtype: stores saturate there (OCP OFP8 spec rev. 1.0, table 1).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def normalize_kv_cache_dtype(name: str) -> str:
    """The canonical `--kv-cache-dtype` key of `name` (case and surrounding blanks ignored).

    Raises:
        ValueError: `name` is not one of `KV_CACHE_DTYPES` (the sentence lists them).
    """
    key = str(name).strip().lower()
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name} is not supported; use one of {', '.join(KV_CACHE_DTYPES)} "
                         "(auto = the model dtype).")
    return key


def kv_cache_dtype(name: str, model_dtype: torch.dtype | str) -> torch.dtype:
    """The KV cache's storage dtype for `--kv-cache-dtype name`: the model dtype for "auto", else fp8.

    Raises:
        ValueError: `name` is not one of `KV_CACHE_DTYPES` (the sentence lists them).
    """
    dtype = KV_CACHE_DTYPES[normalize_kv_cache_dtype(name)]
    return dtype if dtype is not None else (parse_dtype(model_dtype) if isinstance(model_dtype, str)
                                            else model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the fp8 storage dtypes of the KV cache (float8_e4m3fn, float8_e5m2)."""
    return dtype in FP8_KV_DTYPES


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a torch dtype, a model-dtype spelling ("bf16", "half", ...) or "torch.float16".

    "auto" is not a dtype: resolve it first (`config.resolve`, `platforms`).

    Raises:
        ValueError: an unknown name (the message lists the accepted ones).
    """
    if isinstance(name, torch.dtype):
        return name
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_ALIASES:
        raise ValueError(f"Unknown dtype {name!r}; use auto, float16, bfloat16 or float32 "
                         f"(or one of {', '.join(DTYPE_ALIASES)}).")
    return DTYPE_ALIASES[key]


def dtype_name(dtype: torch.dtype | str) -> str:
    """The canonical name: torch.bfloat16 -> "bfloat16", "half" -> "float16", float8_e4m3fn -> "float8_e4m3fn".

    Raises:
        ValueError: a name `parse_dtype` rejects.
    """
    if isinstance(dtype, str):
        dtype = _STORAGE_DTYPES.get(dtype) or parse_dtype(dtype)
    return str(dtype).removeprefix("torch.")


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element: 4 for float32, 2 for float16/bfloat16, 1 for fp8; names as `dtype_name` takes.

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        dtype = _STORAGE_DTYPES.get(key) or parse_dtype(key)
    return dtype.itemsize
