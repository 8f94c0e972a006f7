"""FusedMoE: the experts of a sparse MoE block as two stacked weights, tensor-parallel.

Weights per rank (I_p = intermediate_size / tp, each rank holds a slice of
every expert's intermediate dim, as Megatron's column/row split of an MLP):

    w13_weight [E, 2 * I_p, H]   rows [0, I_p) = gate (w1), [I_p, 2 I_p) = up (w3)
    w2_weight  [E, H, I_p]       down (w2), columns split

so the expert outputs of a rank are partial sums and one all-reduce after
the block completes them. With `has_bias` (gpt-oss) each expert also has

    w13_bias [E, 2 * I_p]        gate then up, sliced like w13_weight's rows
    w2_bias  [E, H]              whole on every rank, added by rank 0 only
                                 (the all-reduce would otherwise add it tp times)
 The router (the `gate` linear) is replicated and
lives in the model. Computation: the Triton grouped GEMM on CUDA, the
PyTorch reference elsewhere (`fused_experts`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from tokenmill.layers.fused_moe.reference import fused_experts_reference, select_experts


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Expert computation on the best path for the device: Triton on CUDA, PyTorch elsewhere.

    Shapes as `fused_experts_reference`: hidden [T, H], w13 [E, 2I, H],
    w2 [E, H, I], topk [T, k], optional w13_bias [E, 2I], w2_bias [E, H] -> [T, H].
    """
    if hidden_states.is_cuda:
        return kernels.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation,
                                     w13_bias=w13_bias, w2_bias=w2_bias)
    return fused_experts_reference(hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)


class FusedMoE(nn.Module):
    """Top-k routed experts with gated MLPs.

    Args:
        num_experts: E.
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: each expert's full intermediate size I (split across TP ranks).
        renormalize: renormalise the top-k routing weights to sum to 1.
        activation: "silu", "gelu" or "swigluoai" (`kernels.moe_activation`).
        reduce_results: all-reduce the partial sums across TP ranks in forward.
        has_bias: per-expert biases on both projections (module docstring).

    forward(hidden_states [T, H], router_logits [T, E]) -> [T, H].

    Raises:
        ValueError: intermediate_size not divisible by tensor_parallel_size,
            or top_k outside [1, num_experts].
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, activation: str = "silu", reduce_results: bool = True,
                 has_bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"MoE intermediate size ({intermediate_size}) is not divisible by "
                             f"tensor_parallel_size ({self.tp_size}).")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                             f"({num_experts}).")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.activation = activation
        self.reduce_results = reduce_results
        self.intermediate_size_per_partition = i_p = intermediate_size // self.tp_size
        dtype = torch.get_default_dtype()
        self.create_weights(num_experts, hidden_size, intermediate_size, dtype)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if has_bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * i_p, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
            self.w13_bias.weight_loader = self.bias_loader
            self.w2_bias.weight_loader = self.bias_loader
            self.w13_bias.full_shape = (num_experts, 2 * intermediate_size)

    def create_weights(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        """The expert weights `w13_weight` / `w2_weight` (a packed-weight subclass makes its own instead)."""
        i_p = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i_p, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i_p, dtype=dtype), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # Unsharded shapes (stacked experts), for loaders that draw full tensors (dummy weights).
        self.w13_weight.full_shape = (num_experts, 2 * intermediate_size, hidden_size)
        self.w2_weight.full_shape = (num_experts, hidden_size, intermediate_size)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2 I_p, H], w2 [E, H, I_p]) in the model dtype, as the expert GEMMs take them."""
        return self.w13_weight, self.w2_weight

    def bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's part of a stacked expert bias: `w13_bias` from `[E, 2I]` (gate then up
        halves), `w2_bias` from `[E, H]` (whole).

        Raises:
            ValueError: a shape that does not fit.
        """
        if param is self.w13_bias:
            i_p, rank = self.intermediate_size_per_partition, self.tp_rank
            full_i = loaded_weight.shape[-1] // 2
            loaded_weight = torch.cat([loaded_weight[..., rank * i_p:(rank + 1) * i_p],
                                       loaded_weight[..., full_i + rank * i_p:full_i + (rank + 1) * i_p]], dim=-1)
        if loaded_weight.shape != param.shape:
            raise ValueError(f"Expert bias of shape {tuple(loaded_weight.shape)} does not fit parameter of shape "
                             f"{tuple(param.shape)}.")
        param.data.copy_(loaded_weight)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None,
                      expert_id: int | None = None) -> None:
        """Copy this rank's slice of a full checkpoint tensor into `param`.

        Args:
            param: `w13_weight` or `w2_weight`.
            loaded_weight: one expert's `[I, H]` (w1 gate / w3 up) or `[H, I]`
                (w2 down) with `expert_id`; or all experts stacked (`[E, I, H]`,
                `[E, H, I]`, or HF 5's `gate_up_proj [E, 2I, H]` with shard_id
                "w13") with expert_id None.
            shard_id: "w1", "w3", "w2" or "w13"; None = the whole stacked
                parameter ("w13" for w13_weight, "w2" for w2_weight).

        Raises:
            ValueError: an unknown shard_id or a shape that does not fit.
        """
        i_p, rank = self.intermediate_size_per_partition, self.tp_rank
        if shard_id is None:
            shard_id = "w13" if param is self.w13_weight else "w2"
        if expert_id is None:
            experts = range(self.num_experts)
            if loaded_weight.shape[0] != self.num_experts:
                raise ValueError(f"Stacked expert tensor has {loaded_weight.shape[0]} experts, expected "
                                 f"{self.num_experts}.")
        else:
            experts, loaded_weight = [expert_id], loaded_weight.unsqueeze(0)
        if shard_id == "w13":
            full_i = loaded_weight.shape[1] // 2
            gate = loaded_weight[:, rank * i_p:(rank + 1) * i_p]
            up = loaded_weight[:, full_i + rank * i_p:full_i + (rank + 1) * i_p]
            src, dst = torch.cat([gate, up], dim=1), param.data[experts[0]:experts[-1] + 1]
        elif shard_id in ("w1", "w3"):
            offset = 0 if shard_id == "w1" else i_p
            src = loaded_weight[:, rank * i_p:(rank + 1) * i_p]
            dst = param.data[experts[0]:experts[-1] + 1, offset:offset + i_p]
        elif shard_id == "w2":
            src = loaded_weight[:, :, rank * i_p:(rank + 1) * i_p]
            dst = param.data[experts[0]:experts[-1] + 1]
        else:
            raise ValueError(f"Unknown expert shard_id {shard_id!r}; expected 'w1', 'w2', 'w3' or 'w13'.")
        if src.shape != dst.shape:
            raise ValueError(f"Expert checkpoint tensor of shape {tuple(loaded_weight.shape)} ({shard_id}) does not "
                             f"fit parameter slice of shape {tuple(dst.shape)}.")
        dst.copy_(src)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        # Under TP the down bias joins on rank 0 only: the all-reduce sums the ranks' partial outputs.
        w2_bias = self.w2_bias if self.tp_rank == 0 else None
        w13, w2 = self.expert_weights()
        out = fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, self.activation, self.w13_bias, w2_bias)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"intermediate_size_per_partition={self.intermediate_size_per_partition}")


# Checkpoint projection name -> FusedMoE shard id: Mixtral's w1/w2/w3 and Qwen-MoE's gate/up/down.
_EXPERT_SHARDS = {"w1": "w1", "w3": "w3", "w2": "w2", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PER_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")


def load_expert_weight(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
    """Load `name` into a FusedMoE parameter if it is an expert weight; else return None.

    Accepts per-expert names (`...experts.3.gate_proj.weight`,
    `...experts.3.w1.weight`), transformers 5's stacked ones
    (`...experts.gate_up_proj [E, 2I, H]`, `...experts.down_proj [E, H, I]`)
    and GGUF's stacked ones (`...experts.gate_proj.weight [E, I, H]`, ...). The FusedMoE module
    must sit at the checkpoint's `...experts` path.

    Returns:
        The parameter name written, or None when `name` is not an expert
        weight or the model has no such FusedMoE parameter (the caller then
        skips it, for a layer on another pipeline stage, or reports it).
    """
    m = _PER_EXPERT_RE.match(name)
    if m:
        prefix, expert, proj = m.groups()
        shard_id, expert_id = _EXPERT_SHARDS[proj], int(expert)
    else:
        m = _STACKED_RE.match(name)
        if not m:
            return None
        prefix, proj = m.groups()
        shard_id, expert_id = ("w13" if proj == "gate_up_proj" else _EXPERT_SHARDS[proj]), None
    target = f"{prefix}.{'w2' if shard_id == 'w2' else 'w13'}_weight"
    param = params.get(target)
    if param is None:
        return None  # not on this pipeline stage, or no such module: the caller's generic path decides
    param.weight_loader(param, tensor, shard_id, expert_id)
    return target
