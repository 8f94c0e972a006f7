"""What the engine asks of a device platform: type, capability, dtypes."""

from __future__ import annotations

import torch


class Platform:
    """Base platform; subclasses fill in the device facts.

    `device_type` is the torch device type ("cpu" or "cuda").
    """

    device_type: str = ""

    def get_device_capability(self, device_id: int = 0) -> tuple[int, int] | None:
        """(major, minor) compute capability, or None where the notion does not apply (CPU)."""
        return None

    def get_device_name(self, device_id: int = 0) -> str:
        return self.device_type

    def total_memory_bytes(self, device_id: int = 0) -> int | None:
        """Device memory in bytes, or None when it is the host's memory (CPU)."""
        return None

    def supported_dtypes(self) -> list[torch.dtype]:
        """Model dtypes this device can run."""
        return [torch.float32]

    def default_dtype(self) -> torch.dtype:
        """The dtype `--dtype auto` picks on this device."""
        return torch.float32

    def default_dtype_reason(self) -> str:
        """One sentence saying why `default_dtype()` was chosen (for the start-up log)."""
        return ""
