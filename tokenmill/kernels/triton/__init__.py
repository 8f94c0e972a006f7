"""Triton kernels (CUDA): paged attention, KV-cache write, split merge, RMSNorm, RoPE, gated activations,
fused MoE. Each module imports triton; call them through `tokenmill.kernels`."""
