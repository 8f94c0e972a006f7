"""Compile the FP8 grouped-MoE kernel for sm_70 (V100), sm_89 (Ada, W8A8) and sm_90 (H100/H200) without a GPU.

Same mechanism as test_mxfp4_compile.py (triton.compile with an explicit GPUTarget in a subprocess without
TRITON_INTERPRET; ptxas -v from the triton wheel). The variants are launches `fused_experts_fp8_triton` picks
(`fused_moe_fp8.DEFAULT_CONFIGS*`): cc 7.0 float16 with 32 x 32 weight tiles and one stage (gate/up with block
scales, down with per-channel scales and the routing weight); cc 9.0 bfloat16, every row of the default
table with block scales, and every row of the W8A8 table (fp8 operands, block scales, 1 x 128 activation
groups) for cc 9.0, its largest tiles for cc 8.9. sm_70's PTX must hold no FP8 conversion (the e4m3 bytes are decoded with integer operations); sm_90's
dots must reach the tensor cores (e4m3 x e4m3 MMAs for W8A8).
"""

from __future__ import annotations

import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json
    from compile_helpers import compile_with_ptxas
    from tokenmill.kernels.triton import fused_moe_fp8 as f8

    def compile_one(name, cc, act, out, cx, warps, stages):
        fp8 = cx["A_FP8"]
        ptrs = {"a_ptr": "*fp8e4nv" if fp8 else act, "w_ptr": "*fp8e4nv" if fp8 else "*u8", "s_ptr": "*fp32",
                "a_scale_ptr": "*fp32", "bias_ptr": act, "c_ptr": out, "topk_weights_ptr": "*fp32",
                "sorted_pair_ids_ptr": "*i32", "tile_expert_ids_ptr": "*i32", "num_pairs_post_padded_ptr": "*i32"}
        marker = "e4m3" if cc == 70 else "e4m3.e4m3" if fp8 else "mma"
        # W8A8 rows as a launch specializes them (aligned pointers, unit K strides): the fp8 tiles then go
        # through cp.async into shared memory, pipelined; unspecialized they would be staged through registers.
        aligned = ("a_ptr", "w_ptr", "s_ptr", "a_scale_ptr", "bias_ptr", "c_ptr", "topk_weights_ptr",
                   "sorted_pair_ids_ptr", "tile_expert_ids_ptr", "num_pairs_post_padded_ptr", "N", "K", "stride_am",
                   "stride_we", "stride_wn", "stride_cm") if fp8 else ()
        if fp8:
            cx = dict(cx, stride_ak=1, stride_wk=1, stride_cn=1)
        r = compile_with_ptxas(name, f8.grouped_fp8_gemm_kernel, cc, ptrs, cx, warps, stages, ptx_marker=marker,
                               aligned=aligned)
        if fp8:
            # at least two buffers of the [BLOCK_N + BLOCK_M, BLOCK_K] fp8 tiles (sm_90 takes num_stages of them,
            # sm_89 num_stages - 1)
            r["pipelined"] = r["shared"] >= 2 * (c_tile := cx["BLOCK_K"] * (cx["BLOCK_N"] + cx["BLOCK_M"]))
            r["stage_bytes"] = c_tile
        r["marker"] = r.pop("ptx_has_marker")
        return r

    def cx(**kw):
        base = dict(TOP_K_DIV=8, MUL_ROUTED_WEIGHT=False, HAS_BIAS=False, BLOCK_SCALES=False, A_FP8=False,
                    A_GROUP=False, IEEE_FP32=False, CLAMP_FP16=False, ROUND=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
        base.update(kw)
        return base

    results = []
    results.append(compile_one("cc70_gate_up_m16", 70, "*fp16", "*fp16",
                               cx(BLOCK_SCALES=True, CLAMP_FP16=True, ROUND=1), 4, 1))
    results.append(compile_one("cc70_down_m32", 70, "*fp16", "*fp32",
                               cx(BLOCK_M=32, TOP_K_DIV=1, MUL_ROUTED_WEIGHT=True, ROUND=0), 4, 1))
    # Every row of DEFAULT_CONFIGS with block scales (the most registers).
    for _, c in f8.DEFAULT_CONFIGS:
        results.append(compile_one(f"cc90_m{c.block_m}", 90, "*bf16", "*bf16",
                                   cx(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_SCALES=True),
                                   c.num_warps, c.num_stages))
    # W8A8: every row of DEFAULT_CONFIGS_W8A8 with block weight scales and 1 x 128 activation groups.
    # sm_90 (wgmma) every row; sm_89 (Ada: mma.sync, 99 KB of shared memory) the largest tiles.
    for cc, rows in ((89, f8.DEFAULT_CONFIGS_W8A8[-1:]), (90, f8.DEFAULT_CONFIGS_W8A8)):
        for _, c in rows:
            results.append(compile_one(f"cc{cc}_w8a8_m{c.block_m}", cc, "*bf16", "*bf16",
                                       cx(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_SCALES=True,
                                          A_FP8=True, A_GROUP=True),
                                       c.num_warps, c.num_stages))
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_fp8_moe_kernel_compiles_for_sm70_sm89_and_sm90(compiled_kernels):
    results = compiled_kernels(__name__)  # SCRIPT, run with the other compile checks
    assert [(r["kernel"], r["cc"]) for r in results] == [
        ("cc70_gate_up_m16", 70), ("cc70_down_m32", 70), ("cc90_m16", 90), ("cc90_m32", 90), ("cc90_m64", 90),
        ("cc89_w8a8_m64", 89),
        ("cc90_w8a8_m16", 90), ("cc90_w8a8_m32", 90), ("cc90_w8a8_m64", 90),
    ]
    for r in results:
        assert r["ptx_target"] == [{70: "sm_70", 89: "sm_89", 90: "sm_90a"}[r["cc"]]], r
        assert r["cubin_bytes"] > 0 and r["shared"] <= {70: 96, 89: 99, 90: 227}[r["cc"]] * 1024, r
        # sm_70: no FP8 conversion instruction in the PTX; sm_89 / sm_90: tensor-core dots (mma / wgmma),
        # e4m3 x e4m3 ones for W8A8.
        assert r["marker"] == (r["cc"] != 70), r
        assert r["registers"] <= 255 and r["spill_bytes"] == 0, r
        assert r.get("pipelined", True), r  # W8A8: the fp8 tiles pipelined through shared memory
