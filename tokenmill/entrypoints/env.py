"""`tokenmill env`: what this machine can run, and why not when it cannot.

Prints OS, Python, torch (with the GPU architectures its kernels were built
for), CUDA runtime and driver, Triton, and per GPU: name, memory, compute
capability, usable dtypes and attention backends with the reason for each
unusable one, and which quantization methods (int4/int8, FP8) run through which
kernel (`quantization.rows_for`). `--json` prints the same as one JSON object. Works without a
GPU (and without triton or nvidia-smi installed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

import torch

from tokenmill.platforms import cuda

logger = logging.getLogger(__name__)


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    """NVIDIA driver version from pynvml if installed, else nvidia-smi; None if neither answers."""
    if importlib.util.find_spec("pynvml") is not None:
        try:
            import pynvml

            pynvml.nvmlInit()
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        except Exception as e:  # noqa: BLE001 - any NVML failure just means "unknown"
            logger.debug("pynvml could not read the driver version: %s", e)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        proc = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            check=False, capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def describe_gpu(
    index: int,
    name: str,
    total_memory_bytes: int,
    capability: tuple[int, int],
    *,
    arch_list: list[str],
    force_cc70: bool,
    triton_available: bool,
    flash_attn_available: bool,
) -> dict[str, Any]:
    """One GPU's facts and what tokenmill can use on it (pure: testable with fakes).

    Returns a dict with name, memory_gib, capability ("9.0"), effective
    capability (7.0 under TOKENMILL_FORCE_CC70), torch_kernels (None when
    the installed torch runs on it, else the error text), dtypes and
    attention_backends (name -> None if usable else the reason).
    """
    eff = cuda.effective_capability(capability, force_cc70)
    device = cuda.describe_device(name, capability)
    try:
        cuda.check_torch_arch_support(capability, device, arch_list)
        torch_kernels = None
    except ValueError as e:
        torch_kernels = str(e)
    dtypes = cuda.dtype_support(eff)
    backends = cuda.attention_backend_support(
        eff, triton_available=triton_available, flash_attn_available=flash_attn_available
    )
    if torch_kernels is not None:  # nothing runs without torch kernels for the device
        reason = "the installed torch has no kernels for this GPU (see torch_kernels)"
        dtypes = {k: v or reason for k, v in dtypes.items()}
        backends = {k: v or reason for k, v in backends.items()}
    return {
        "index": index,
        "name": name,
        "memory_gib": round(total_memory_bytes / 2**30, 1),
        "capability": f"{capability[0]}.{capability[1]}",
        "effective_capability": f"{eff[0]}.{eff[1]}",
        "force_cc70": force_cc70,
        "torch_kernels": torch_kernels,
        "default_dtype": "bfloat16" if cuda.supports_bf16(eff) else "float16",
        "dtypes": dtypes,
        "attention_backends": backends,
        "quantization": quantization_support("cuda", eff),
    }


def quantization_support(device_type: str, capability: tuple[int, int] | None) -> dict[str, dict[str, Any]]:
    """method -> {"bits": [4, 8], "kernel": how it runs here, or "refused: why"} for this device."""
    from tokenmill.quantization import rows_for

    return {row.method: {"bits": list(row.bits), "kernel": row.kernel} for row in rows_for(device_type, capability)}


def collect_env_info() -> dict[str, Any]:
    """Everything `tokenmill env` reports, as plain JSON-able data."""
    triton_version = _package_version("triton")
    cuda_ok = torch.cuda.is_available()
    arch_list = torch.cuda.get_arch_list() if cuda_ok else []
    force = cuda.force_cc70_requested()
    gpus = []
    if cuda_ok:
        flash = importlib.util.find_spec("flash_attn") is not None
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(
                describe_gpu(
                    i, props.name, props.total_memory, (props.major, props.minor),
                    arch_list=arch_list, force_cc70=force,
                    triton_available=triton_version is not None, flash_attn_available=flash,
                )
            )
    return {
        "tokenmill": _package_version("tokenmill"),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # CUDA runtime torch was built with; None on CPU builds
        "torch_arch_list": arch_list,
        "cuda_available": cuda_ok,
        "driver": _driver_version(),
        "triton": triton_version,
        "force_cc70": force,
        "gpus": gpus,
        "cpu": {
            "dtypes": {"float32": None, "bfloat16": None, "float16": None},
            "default_dtype": "float32",
            "attention_backends": {
                "TORCH_SDPA": None,
                "TRITON_ATTN": "needs a CUDA GPU (Triton kernels do not run on the CPU)",
            },
            "quantization": quantization_support("cpu", None),
        },
    }


def render_text(info: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [
        f"tokenmill      {info['tokenmill'] or 'not installed (running from source)'}",
        f"OS             {info['os']}",
        f"Python         {info['python']}",
        f"CPU cores      {info['cpu_count']}",
        f"torch          {info['torch']}",
        f"torch CUDA     {info['torch_cuda'] or 'none (CPU build)'}",
        f"torch archs    {' '.join(info['torch_arch_list']) or '-'}",
        f"NVIDIA driver  {info['driver'] or 'not found'}",
        f"Triton         {info['triton'] or 'not installed'}",
    ]
    if info["force_cc70"]:
        lines.append(f"{cuda.FORCE_CC70_ENV}=1: GPUs are treated as compute capability 7.0")
    if not info["gpus"]:
        lines.append("GPU            none: tokenmill runs on the CPU")
        lines.extend(_support_lines(info["cpu"]))
    for gpu in info["gpus"]:
        cc = gpu["capability"]
        if gpu["effective_capability"] != cc:
            cc += f" (treated as {gpu['effective_capability']})"
        lines.append(f"GPU {gpu['index']:<10} {gpu['name']}, {gpu['memory_gib']} GiB, compute capability {cc}")
        if gpu["torch_kernels"]:
            lines.append(f"  torch        {gpu['torch_kernels']}")
        lines.extend(_support_lines(gpu))
    return "\n".join(lines)


def _support_lines(device: dict[str, Any]) -> list[str]:
    """`usable: ...` lines for dtypes and attention backends, then one `not X: why` line each."""
    lines = []
    for title, key in (("dtypes", "dtypes"), ("attention", "attention_backends")):
        table = device[key]
        ok = ", ".join(k for k, v in table.items() if v is None) or "none"
        extra = f" (default {device['default_dtype']})" if key == "dtypes" else ""
        lines.append(f"  {title:<12} usable: {ok}{extra}")
        lines.extend(f"    not {k}: {v}" for k, v in table.items() if v is not None)
    by_kernel: dict[str, list[str]] = {}  # methods that run the same way share one line
    for method, row in device.get("quantization", {}).items():
        weights = "e4m3" if method == "fp8" else "/".join(f"int{b}" for b in row["bits"])
        by_kernel.setdefault(row["kernel"], []).append(f"{method} {weights}")
    for kernel, methods in by_kernel.items():
        lines.append(f"  {'quantized':<12} {', '.join(methods)}: {kernel}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tokenmill env [--json]`; returns the exit code (0)."""
    parser = argparse.ArgumentParser(prog="tokenmill env", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of text.")
    args = parser.parse_args(argv)
    info = collect_env_info()
    print(json.dumps(info, indent=2) if args.json else render_text(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
