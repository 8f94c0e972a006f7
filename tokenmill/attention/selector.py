"""Pick the attention backend for a device (the table in docs/architecture.md)."""

from __future__ import annotations

import logging

from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.kernels.cpu import decode as cpu_decode

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("TORCH_SDPA", "TRITON_ATTN")


def _triton_backend():
    """A TritonAttentionBackend, or raise ImportError when Triton cannot be used."""
    from tokenmill.attention.backends.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend()


def get_attn_backend(device_type: str, requested_name: str | None = None):
    """Return an attention backend instance for `device_type` ("cpu" or "cuda").

    Defaults: CPU -> TORCH_SDPA; CUDA -> TRITON_ATTN when it imports, else
    TORCH_SDPA (logged). On CPU the C decode kernel is built here, at start-up
    (once per machine, then cached), not at the first decode.

    Raises:
        ValueError: `requested_name` is not a known backend, or TRITON_ATTN is
            asked for on a device other than CUDA, or it cannot be imported.
    """
    name = requested_name.upper() if requested_name else None
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"Unknown attention backend {requested_name!r}; choose one of {', '.join(BACKEND_NAMES)}.")
    if device_type == "cpu":
        cpu_decode.load_kernel()
    if name == "TORCH_SDPA":
        return TorchSDPABackend()
    if name == "TRITON_ATTN":
        if device_type != "cuda":
            raise ValueError(
                f"The TRITON_ATTN attention backend needs a CUDA GPU, but the device is {device_type!r}; "
                "use --attention-backend TORCH_SDPA."
            )
        try:
            return _triton_backend()
        except ImportError as e:
            raise ValueError(f"TRITON_ATTN is not available ({e}); use --attention-backend TORCH_SDPA.") from e
    if device_type == "cuda":
        try:
            return _triton_backend()
        except ImportError as e:
            logger.info("TRITON_ATTN unavailable (%s); using TORCH_SDPA.", e)
    return TorchSDPABackend()
