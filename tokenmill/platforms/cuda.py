"""The CUDA platform: capability detection and dtype defaults.

bfloat16 needs compute capability >= 8.0 (Ampere); older GPUs (V100 is
7.0) run float16. Env TOKENMILL_FORCE_CC70=1 makes any GPU report 7.0 so the
old-GPU paths can be tested on a new one.
"""

from __future__ import annotations

import os

import torch

from tokenmill.platforms.interface import Platform


def force_cc70() -> bool:
    """True when env TOKENMILL_FORCE_CC70 asks to simulate a compute-capability-7.0 GPU."""
    return os.environ.get("TOKENMILL_FORCE_CC70", "0").lower() in ("1", "true", "yes")


class CudaPlatform(Platform):
    device_type = "cuda"

    def get_device_capability(self, device_id: int = 0) -> tuple[int, int]:
        if force_cc70():
            return (7, 0)
        return torch.cuda.get_device_capability(device_id)

    def get_device_name(self, device_id: int = 0) -> str:
        name = torch.cuda.get_device_name(device_id)
        return f"{name} (simulated cc 7.0)" if force_cc70() else name

    def total_memory_bytes(self, device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).total_memory

    def has_bf16(self, device_id: int = 0) -> bool:
        return self.get_device_capability(device_id) >= (8, 0)

    def supported_dtypes(self) -> list[torch.dtype]:
        if self.has_bf16():
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.has_bf16() else torch.float16

    def default_dtype_reason(self) -> str:
        major, minor = self.get_device_capability()
        if self.has_bf16():
            return f"bfloat16 on {self.get_device_name()} (compute capability {major}.{minor} >= 8.0)"
        return (f"float16 on {self.get_device_name()}: compute capability {major}.{minor} < 8.0 "
                "has no bfloat16 support")
