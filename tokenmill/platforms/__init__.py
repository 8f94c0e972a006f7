"""The device platform the engine runs on (CPU or CUDA) and its defaults."""

from __future__ import annotations

import torch

from tokenmill.platforms.interface import Platform


def current_platform(device: str | None = "auto") -> Platform:
    """The platform for `device` ("auto"/None: CUDA when available, else CPU; "cpu"; "cuda").

    Raises:
        ValueError: "cuda" is asked for but no CUDA device is available, or
            the device name is unknown.
    """
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was given but PyTorch sees no CUDA GPU; use --device cpu "
                             "(or install a CUDA build of PyTorch).")
        from tokenmill.platforms.cuda import CudaPlatform

        return CudaPlatform()
    if device == "cpu":
        from tokenmill.platforms.cpu import CpuPlatform

        return CpuPlatform()
    raise ValueError(f"Unknown device {device!r}; use auto, cpu or cuda.")


__all__ = ["Platform", "current_platform"]
