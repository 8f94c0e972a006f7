"""The CPU platform."""

from __future__ import annotations

import torch

from tokenmill.platforms.interface import Platform


class CpuPlatform(Platform):
    device_type = "cpu"

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def default_dtype(self) -> torch.dtype:
        # float32, not bf16: CPU matmuls gain little from bf16, and the bundled
        # 135M model (Q4_1 weights) drifts from its float32 reference answer in
        # bf16 within a few tokens; small models have no precision to spare.
        return torch.float32

    def default_dtype_reason(self) -> str:
        return "float32 on CPU: bfloat16 is not faster there and changes small models' answers"
