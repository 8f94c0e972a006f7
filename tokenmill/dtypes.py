"""The one dtype table: names <-> torch dtypes, accepted spellings, sizes in bytes.

Model dtypes are float32, float16 and bfloat16; `--dtype` also takes vLLM's
spellings (half, float, fp16, bf16, fp32) and "auto", which each platform
resolves (`platforms/`: bfloat16 on CUDA cc >= 8.0, float16 below, float32 on
CPU). fp8 (float8_e4m3fn) appears only as a storage dtype (KV cache, weights).
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
                                           "float8_e4m3fn": torch.float8_e4m3fn}


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
