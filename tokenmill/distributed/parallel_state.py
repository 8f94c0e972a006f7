"""Tensor-parallel process group state and the collectives the layers use.

With no group initialized (the single-device default) the rank is 0, the
world size is 1 and every collective returns its input unchanged, so layers
can call them unconditionally. A multi-process executor calls
`initialize_model_parallel(tp_size)` after `torch.distributed.init_process_group`
(NCCL on GPU, gloo on CPU) and `destroy_model_parallel()` at shutdown.

Layout as Megatron-LM / vLLM: with world size W and tensor-parallel size
tp, ranks [0, tp), [tp, 2 tp), ... form the tensor-parallel groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# The tensor-parallel group of this process; None = single device.
_TP_GROUP: dist.ProcessGroup | None = None
_TP_RANK: int = 0
_TP_SIZE: int = 1


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> None:
    """Create the tensor-parallel groups over the default process group.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: the world size is not a multiple of `tensor_model_parallel_size`.
    """
    global _TP_GROUP, _TP_RANK, _TP_SIZE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group first.")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    tp = tensor_model_parallel_size
    if tp < 1 or world_size % tp != 0:
        raise ValueError(f"tensor_parallel_size={tp} must be >= 1 and divide the world size {world_size}.")
    for start in range(0, world_size, tp):
        ranks = list(range(start, start + tp))
        # Every process must call new_group for every group, in the same order.
        group = dist.new_group(ranks)
        if rank in ranks:
            _TP_GROUP, _TP_RANK, _TP_SIZE = group, rank - start, tp


def destroy_model_parallel() -> None:
    """Forget the tensor-parallel group (back to rank 0 of 1)."""
    global _TP_GROUP, _TP_RANK, _TP_SIZE
    _TP_GROUP, _TP_RANK, _TP_SIZE = None, 0, 1


def model_parallel_is_initialized() -> bool:
    return _TP_GROUP is not None


def get_tp_group() -> dist.ProcessGroup | None:
    """The tensor-parallel process group, or None on a single device."""
    return _TP_GROUP


def get_tensor_model_parallel_rank() -> int:
    """This process's rank inside its tensor-parallel group (0 when single-device)."""
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    """Number of processes sharing each layer (1 when single-device)."""
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place when distributed); no-op at size 1."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order; no-op at size 1.

    `x`: same shape on every rank. Returns shape with `dim` multiplied by the
    world size.
    """
    if _TP_SIZE == 1:
        return x
    dim = dim % x.dim()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
