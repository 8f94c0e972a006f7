"""Tensor- and pipeline-parallel process-group state and the collectives the layers use.

With no group initialized (the single-device default) every rank and size
is 0 / 1 and every collective returns its input unchanged, so layers can
call them unconditionally. A multi-process worker calls
`initialize_model_parallel(tp, pp)` after `torch.distributed.init_process_group`
(NCCL on GPU, gloo on CPU) and `destroy_model_parallel()` at shutdown.

Rank layout as Megatron-LM / vLLM, world size W = tp * pp, global rank
`rank = pp_rank * tp + tp_rank`:

    tp=2, pp=2:      tp_rank 0   tp_rank 1
        stage 0      rank 0      rank 1        <- a tensor-parallel group
        stage 1      rank 2      rank 3
                     ^ a pipeline group (ranks 0 and 2)

Stage i sends its hidden states to the rank with the same tp_rank in
stage i + 1; the last stage computes logits, and its tp_rank 0 (global
rank W - tp, the "output rank") returns the step's result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# The tensor-parallel group of this process; None = single device.
_TP_GROUP: dist.ProcessGroup | None = None
_TP_RANK: int = 0
_TP_SIZE: int = 1
_PP_RANK: int = 0
_PP_SIZE: int = 1


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Create the tensor-parallel groups over the default process group and record the stage.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: the world size is not `tensor_model_parallel_size * pipeline_model_parallel_size`.
    """
    global _TP_GROUP, _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group first.")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or pp < 1 or tp * pp != world_size:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} must equal the world size "
                         f"{world_size}.")
    for start in range(0, world_size, tp):
        ranks = list(range(start, start + tp))
        # Every process must call new_group for every group, in the same order.
        group = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            _TP_GROUP, _TP_RANK, _TP_SIZE = group, rank - start, tp
    _PP_RANK, _PP_SIZE = rank // tp, pp


def destroy_model_parallel() -> None:
    """Forget the groups (back to rank 0 of 1)."""
    global _TP_GROUP, _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE
    _TP_GROUP, _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE = None, 0, 1, 0, 1


def model_parallel_is_initialized() -> bool:
    return _TP_SIZE > 1 or _PP_SIZE > 1


def get_tp_group() -> dist.ProcessGroup | None:
    """The tensor-parallel process group, or None on a single device."""
    return _TP_GROUP


def get_tensor_model_parallel_rank() -> int:
    """This process's rank inside its tensor-parallel group (0 when single-device)."""
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    """Number of processes sharing each layer (1 when single-device)."""
    return _TP_SIZE


def get_pp_rank() -> int:
    """This process's pipeline stage (0 when not pipelined)."""
    return _PP_RANK


def get_pp_world_size() -> int:
    """Number of pipeline stages (1 when not pipelined)."""
    return _PP_SIZE


def is_first_pp_rank() -> bool:
    return _PP_RANK == 0


def is_last_pp_rank() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def get_output_rank() -> int:
    """Global rank whose step result the executor returns: tp_rank 0 of the last stage."""
    return (_PP_SIZE - 1) * _TP_SIZE


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
