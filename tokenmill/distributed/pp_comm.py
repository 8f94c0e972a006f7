"""Pipeline-parallel hand-off: hidden states + residual from one stage to the next.

Each step every rank knows the number of tokens T from the SchedulerOutput,
so stage i sends one `[2, T, H]` tensor (hidden_states stacked on residual)
to the rank with the same tp_rank in stage i + 1 and no shapes travel. The
pipeline is not overlapped: stage i + 1 waits for stage i within a step.
After the last stage samples, `broadcast_sampled_token_ids` gives every
rank the step's tokens (each rank's InputBatch needs them for the next
decode input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenmill.distributed import parallel_state as ps


@dataclass(slots=True)
class IntermediateTensors:
    """What a non-last stage's model forward returns and the next stage's takes.

    hidden_states, residual: [T, hidden_size] in the model dtype (the
    residual stream is carried separately for the fused add + RMSNorm).
    """

    hidden_states: torch.Tensor
    residual: torch.Tensor


def send_intermediate(tensors: IntermediateTensors) -> None:
    """Send to the same tp_rank of the next stage (blocking)."""
    dst = dist.get_rank() + ps.get_tensor_model_parallel_world_size()
    dist.send(torch.stack([tensors.hidden_states, tensors.residual]).contiguous(), dst=dst)


def recv_intermediate(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                      device: torch.device) -> IntermediateTensors:
    """Receive `[2, num_tokens, hidden_size]` from the same tp_rank of the previous stage (blocking)."""
    src = dist.get_rank() - ps.get_tensor_model_parallel_world_size()
    buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(buf, src=src)
    return IntermediateTensors(buf[0], buf[1])


def broadcast_sampled_token_ids(token_ids: torch.Tensor | None, num_rows: int, device: torch.device) -> torch.Tensor:
    """Give every rank the output rank's sampled ids.

    Args:
        token_ids: [num_rows] int64 on the output rank (see
            `parallel_state.get_output_rank`); ignored elsewhere (may be None).
        num_rows: rows sampled this step (the same on every rank).
        device: where the result lives (CUDA for NCCL).

    Returns:
        [num_rows] int64, identical on every rank. With one process the
        input is returned unchanged. Sampling on the other last-stage ranks,
        if any, is overwritten, so random sampling needs no shared RNG state.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert token_ids is not None
        return token_ids
    src = ps.get_output_rank()
    if dist.get_rank() == src:
        assert token_ids is not None
        buf = token_ids.to(device=device, dtype=torch.int64).contiguous()
    else:
        buf = torch.empty(num_rows, dtype=torch.int64, device=device)
    dist.broadcast(buf, src=src)
    return buf
