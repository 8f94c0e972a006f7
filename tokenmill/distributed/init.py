"""Joining the process group: backend choice, NCCL environment, model-parallel groups."""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist

from tokenmill.distributed.parallel_state import initialize_model_parallel

logger = logging.getLogger(__name__)

# NVLink SHARP / multicast stays off unless the user asked for it: it needs
# fabric-manager multicast support that lent and virtualized machines often
# lack, and NCCL then hangs or fails at the first collective.
_NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def set_nccl_env_defaults(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Set NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in `env` where the user has not set them."""
    for key, value in _NCCL_ENV_DEFAULTS.items():
        env.setdefault(key, value)


def get_open_port() -> int:
    """A free TCP port on this host (bound, read, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def get_ip() -> str:
    """This host's address other hosts can reach (falls back to 127.0.0.1)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def init_distributed(init_method: str, rank: int, tp_size: int, pp_size: int, device: torch.device) -> None:
    """Join the default process group (NCCL on CUDA, gloo on CPU) and build the TP/PP groups.

    Args:
        init_method: torch.distributed URL, e.g. "tcp://10.0.0.1:29500" (rank 0's host).
        rank: this process's global rank in [0, tp_size * pp_size).
        device: this rank's device (already selected with torch.cuda.set_device on CUDA).
    """
    world_size = tp_size * pp_size
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            set_nccl_env_defaults()
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                                device_id=device if device.type == "cuda" else None)
        logger.info("rank %d/%d joined the %s process group", rank, world_size, backend)
    initialize_model_parallel(tp_size, pp_size)
