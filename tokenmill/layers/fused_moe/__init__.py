"""Mixture-of-experts layer: routing, a PyTorch reference and a Triton grouped GEMM (CUDA)."""

from tokenmill.layers.fused_moe.layer import FusedMoE, expert_module, fused_experts, load_expert_weight
from tokenmill.layers.fused_moe.reference import fused_experts_reference, select_experts

__all__ = ["FusedMoE", "expert_module", "fused_experts", "fused_experts_reference", "load_expert_weight",
           "select_experts"]
