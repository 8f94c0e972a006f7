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


def warn_if_cuda_torch_without_gpu() -> bool:
    """Log a warning when this torch is a CUDA build but no GPU is visible (it then runs on CPU). Returns True if so.

    A CUDA build on a CPU-only machine works, but it is gigabytes larger and
    its CPU kernels are no faster than the CPU build's.
    """
    import logging

    if torch.version.cuda is None or torch.cuda.is_available():
        return False
    logging.getLogger(__name__).warning(
        "This PyTorch (%s) is a CUDA %s build, but no NVIDIA GPU is visible, so tokenmill runs on the CPU. On a "
        "machine without a GPU the CPU build is much smaller: pip install torch --index-url "
        "https://download.pytorch.org/whl/cpu", torch.__version__, torch.version.cuda)
    return True


__all__ = ["Platform", "current_platform", "warn_if_cuda_torch_without_gpu"]
