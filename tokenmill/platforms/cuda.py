"""The CUDA platform: capability detection, dtype defaults, kernel availability.

`CudaPlatform` answers for the visible device; the rules below it are pure
functions of (capability, device name, torch build facts) so they are
testable on a CPU-only machine with fake capabilities. The config resolver
and `tokenmill env` call them; nothing here touches a GPU except
`CudaPlatform`, `apply_cc70_settings` (torch SDPA switches),
`current_device_facts`, `check_visible_gpus` and `prepare_cuda_device`.

Env TOKENMILL_FORCE_CC70=1 (`envs.force_cc70`) makes any GPU report 7.0 so
the old-GPU paths can be tested on a new one.

Facts used (NVIDIA CUDA C Programming Guide, "Compute Capabilities";
PyTorch release notes):
- bfloat16 arithmetic needs compute capability >= 8.0 (Ampere).
- fp8 (e4m3/e5m2) tensor-core math needs >= 8.9 (Ada/Hopper).
- FlashAttention (and torch's flash SDPA kernel) needs >= 8.0; on 7.x torch
  SDPA must use the math or memory-efficient kernels.
- A cubin built for sm_XY runs on devices XY' with the same major and
  minor >= Y; PTX for compute_XY is JIT-compiled for any device >= X.Y.
- PyTorch's CUDA 12.8+ wheels dropped sm_50/60/70 (Maxwell/Pascal/Volta);
  the CUDA 12.6 wheels still ship them.
"""

from __future__ import annotations

import logging
import re

import torch

from tokenmill import envs
from tokenmill.dtypes import DTYPE_ALIASES
from tokenmill.platforms.interface import Platform

logger = logging.getLogger(__name__)

FORCE_CC70_ENV = "TOKENMILL_FORCE_CC70"
CC70 = (7, 0)

_TORCH_INDEX = "https://download.pytorch.org/whl"


def force_cc70_requested(flag: bool = False) -> bool:
    """True when cc-7.0 simulation is on: `DeviceConfig.force_cc70` or env
    TOKENMILL_FORCE_CC70 (`envs.force_cc70`; raises ValueError on a non-boolean value)."""
    return flag or envs.force_cc70()


def effective_capability(real: tuple[int, int], force_cc70: bool) -> tuple[int, int]:
    """The capability the engine plans for: (7, 0) under simulation, else `real`.

    Simulation only lowers the capability; a device older than 7.0 keeps its own.
    """
    real = (int(real[0]), int(real[1]))
    return min(real, CC70) if force_cc70 else real


def describe_device(name: str, capability: tuple[int, int], forced: bool = False) -> str:
    """`NVIDIA H200 (compute capability 9.0)`, or with the simulation noted."""
    cc = f"{capability[0]}.{capability[1]}"
    if forced:
        return f"{name} (compute capability {cc}, simulated via {FORCE_CC70_ENV}=1)"
    return f"{name} (compute capability {cc})"


def supports_bf16(capability: tuple[int, int]) -> bool:
    return tuple(capability) >= (8, 0)


def supports_fp8(capability: tuple[int, int]) -> bool:
    return tuple(capability) >= (8, 9)


def supports_flash_attention(capability: tuple[int, int]) -> bool:
    return tuple(capability) >= (8, 0)


def resolve_cuda_dtype(requested: str, capability: tuple[int, int], device_name: str) -> torch.dtype:
    """Model dtype for a CUDA device.

    Args:
        requested: the `--dtype` value (auto, float16/half/fp16,
            bfloat16/bf16, float32/float/fp32).
        capability: (major, minor), already passed through `effective_capability`.
        device_name: e.g. from `describe_device`, used in messages.

    Returns:
        torch.bfloat16 for `auto` on cc >= 8.0, torch.float16 for `auto`
        below (logged with the reason), else the requested dtype.

    Raises:
        ValueError: unknown dtype, or bfloat16 on a device with cc < 8.0.
    """
    key = requested.strip().lower()
    if key == "auto":
        if supports_bf16(capability):
            logger.info("dtype auto -> bfloat16 on %s.", device_name)
            return torch.bfloat16
        logger.info(
            "dtype auto -> float16 on %s: bfloat16 needs compute capability >= 8.0.", device_name
        )
        return torch.float16
    if key not in DTYPE_ALIASES:
        raise ValueError(
            f"Unknown dtype {requested!r}; use auto, float16, bfloat16 or float32."
        )
    dtype = DTYPE_ALIASES[key]
    if dtype == torch.bfloat16 and not supports_bf16(capability):
        raise ValueError(
            f"{device_name} does not support bfloat16 (it needs compute capability >= 8.0); "
            "start with --dtype float16 (or --dtype auto, which picks float16 there)."
        )
    return dtype


def _arch_number(arch: str) -> tuple[str, int, int, str] | None:
    """'sm_86' -> ('sm', 8, 6, ''), 'compute_90a' -> ('compute', 9, 0, 'a'), '10.0' style -> None."""
    m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([a-z]?)", arch.strip())
    if not m:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)


def torch_arch_supports(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """True when a torch built for `arch_list` (torch.cuda.get_arch_list())
    has kernels that run on a device of `capability`.

    sm_XY (no suffix) runs on same-major devices with minor >= Y; sm_XYa/f
    only on exactly X.Y; compute_XY (PTX) on any device >= X.Y.
    """
    major, minor = int(capability[0]), int(capability[1])
    for arch in arch_list:
        parsed = _arch_number(arch)
        if parsed is None:
            continue
        kind, a_major, a_minor, suffix = parsed
        if kind == "compute" and not suffix and (a_major, a_minor) <= (major, minor):
            return True
        if kind == "sm":
            if suffix and (a_major, a_minor) == (major, minor):
                return True
            if not suffix and a_major == major and a_minor <= minor:
                return True
    return False


def suggest_torch_build(capability: tuple[int, int]) -> str:
    """A pip command installing a torch build with kernels for `capability`."""
    if tuple(capability) < (7, 5):
        tag = "cu126"  # last CUDA line whose wheels ship sm_50/60/70
    else:
        tag = "cu128"  # first CUDA line whose wheels ship Blackwell (sm_100/120)
    return f"pip install torch --index-url {_TORCH_INDEX}/{tag}"


def check_torch_arch_support(
    capability: tuple[int, int],
    device_name: str,
    arch_list: list[str],
    torch_version: str | None = None,
    torch_cuda_version: str | None = None,
) -> None:
    """Fail early when the installed torch has no kernels for the device.

    Args:
        capability: the device's REAL capability (simulation does not change
            which kernels the hardware can run).
        device_name: used in the message.
        arch_list: torch.cuda.get_arch_list(); empty means unknown (no check).
        torch_version, torch_cuda_version: for the message.

    Raises:
        ValueError: naming the device, the build's architectures and a pip
            command for a build that has them, instead of CUDA's later
            "no kernel image is available for execution on the device".
    """
    if not arch_list or torch_arch_supports(capability, arch_list):
        return
    build = f"torch {torch_version or torch.__version__}"
    cuda = torch_cuda_version if torch_cuda_version is not None else torch.version.cuda
    if cuda:
        build += f" (CUDA {cuda})"
    raise ValueError(
        f"{build} has no GPU kernels for {device_name}: it was built for "
        f"{', '.join(arch_list)}. Install a torch build that includes "
        f"sm_{capability[0]}{capability[1]}, e.g. {suggest_torch_build(capability)}"
        + (" (CUDA 12.6 builds still ship sm_70)." if tuple(capability) < (7, 5) else ".")
    )


def triton_launch_settings(capability: tuple[int, int]) -> dict[str, int]:
    """Launch options valid for the device: sm_7x has no cp.async, so the
    Triton kernels run unpipelined (num_stages=1) there."""
    return {"num_stages": 1 if tuple(capability) < (8, 0) else 2}


def apply_cc70_settings(capability: tuple[int, int]) -> None:
    """Restrict torch SDPA to kernels valid below cc 8.0 (math, memory-efficient).

    On a real V100 torch would not pick flash SDPA anyway; under
    TOKENMILL_FORCE_CC70 on a newer GPU this keeps the simulation honest.
    """
    if supports_flash_attention(capability):
        return
    torch.backends.cuda.enable_flash_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    logger.info("Compute capability %d.%d: torch SDPA limited to math and memory-efficient kernels.", *capability)


def dtype_support(capability: tuple[int, int]) -> dict[str, str | None]:
    """dtype name -> None when usable on the device, else the reason why not."""
    cc = f"{capability[0]}.{capability[1]}"
    return {
        "float32": None,
        "float16": None,
        "bfloat16": None if supports_bf16(capability) else f"needs compute capability >= 8.0 (device has {cc})",
        "fp8": None if supports_fp8(capability) else f"needs compute capability >= 8.9 (device has {cc})",
    }


def attention_backend_support(
    capability: tuple[int, int], *, triton_available: bool, flash_attn_available: bool
) -> dict[str, str | None]:
    """Attention backend name -> None when usable on the device, else why not."""
    cc = f"{capability[0]}.{capability[1]}"
    triton_reason = None
    if not triton_available:
        triton_reason = "the triton package is not installed (pip install triton)"
    elif tuple(capability) < (7, 0):
        triton_reason = f"needs compute capability >= 7.0 (device has {cc})"
    flash_reason = None
    if not supports_flash_attention(capability):
        flash_reason = f"needs compute capability >= 8.0 (device has {cc})"
    elif not flash_attn_available:
        flash_reason = "the flash_attn package is not installed (optional)"
    return {"TORCH_SDPA": None, "TRITON_ATTN": triton_reason, "FLASH_ATTN": flash_reason}


def current_device_facts(device_index: int = 0, force_cc70: bool = False) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """(device description, real capability, effective capability) of a visible CUDA device."""
    name = torch.cuda.get_device_name(device_index)
    real = tuple(torch.cuda.get_device_capability(device_index))
    eff = effective_capability(real, force_cc70)
    return describe_device(name, eff, forced=force_cc70 and eff != real), real, eff


def check_visible_gpus() -> None:
    """Start-up check (config resolution): every visible GPU has kernels in the installed torch.

    Raises:
        ValueError: see `check_torch_arch_support`.
    """
    arch_list = torch.cuda.get_arch_list()
    for i in range(torch.cuda.device_count()):
        real = tuple(torch.cuda.get_device_capability(i))
        check_torch_arch_support(real, describe_device(torch.cuda.get_device_name(i), real), arch_list)


def prepare_cuda_device(device_index: int, force_cc70: bool = False) -> tuple[int, int]:
    """Per-process device set-up (each worker, after torch.cuda.set_device):
    check torch's kernels, restrict SDPA on cc < 8.0 (real or simulated).

    Returns:
        The effective capability the worker should plan for.

    Raises:
        ValueError: see `check_torch_arch_support`.
    """
    name, real, eff = current_device_facts(device_index, force_cc70_requested(force_cc70))
    check_torch_arch_support(real, name, torch.cuda.get_arch_list())
    apply_cc70_settings(eff)
    return eff


class CudaPlatform(Platform):
    """The visible CUDA device, as the engine plans for it (capability lowered to 7.0 under force_cc70)."""

    device_type = "cuda"

    def get_device_capability(self, device_id: int = 0) -> tuple[int, int]:
        return effective_capability(torch.cuda.get_device_capability(device_id), force_cc70_requested())

    def get_device_name(self, device_id: int = 0) -> str:
        name = torch.cuda.get_device_name(device_id)
        return f"{name} (simulated cc 7.0)" if force_cc70_requested() else name

    def total_memory_bytes(self, device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).total_memory

    def has_bf16(self, device_id: int = 0) -> bool:
        return supports_bf16(self.get_device_capability(device_id))

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
