"""Compile the quantized-weight Triton kernels for sm_70 (V100) and sm_90 (H100/H200) without a GPU.

Same mechanism as test_triton_compile_sm70.py: triton.compile with an
explicit GPUTarget lowers to PTX and assembles a cubin with the ptxas in the
triton wheel, in a subprocess without TRITON_INTERPRET. The variants are the
launch settings `plan_quant_linear` and the MoE wrapper pick on each device:
cc 7.0 split-K without tl.dot (float16, one stage), the GEMV, the dequantize kernel
(cuBLAS path), the grouped MoE kernel (tl.dot as FMA there); cc 9.0 the
tl.dot split-K / tiled kernels in bfloat16. ptxas -v (the one in the triton
wheel) checks that none of them spills registers.
"""

from __future__ import annotations

import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json
    from compile_helpers import compile_with_ptxas as compile_one
    from tokenmill.kernels.triton.quant_linear import dequantize_kernel, quant_matmul_kernel
    from tokenmill.kernels.triton.quant_gemv import quant_gemv_kernel
    from tokenmill.kernels.triton.quant_dot import quant_dot_kernel
    from tokenmill.kernels.triton.splitk import splitk_reduce_kernel
    from tokenmill.kernels.triton.fused_moe_quant import grouped_quant_gemm_kernel

    def mm_ptrs(act, out):
        return {"x_ptr": act, "qw_ptr": "*i32", "s_ptr": act, "z_ptr": "*u8", "g_ptr": "*i32", "bias_ptr": act, "out_ptr": out}

    def gemv_ptrs(act, out):
        return {"x_ptr": act, "qw_ptr": "*i32", "s_ptr": act, "z_ptr": "*u8", "bias_ptr": act, "out_ptr": out}

    def mm_cx(bits, mode, dot, partial, bm, bn, bk, fp16, one_dot=False):
        return dict(BITS=bits, HAS_ZEROS=True, GROUP_MODE=mode, HAS_BIAS=True, USE_DOT=dot, IEEE_FP32=False,
                    PARTIAL=partial, CLAMP_FP16=fp16, ONE_DOT=one_dot, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)

    def gemv_cx(bits, one_group, partial, bm, bn, bkw, fp16, **more):
        # PREFETCH as a constexpr, as a launch passes it (an i32 argument would compile both of its branches);
        # `more`: other constexprs as a launch on Llama shapes sets them (EVEN_K, ASM)
        return {**dict(BITS=bits, HAS_ZEROS=True, ONE_GROUP=one_group, HAS_BIAS=True, PARTIAL=partial,
                       CLAMP_FP16=fp16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_KW=bkw, PREFETCH=False), **more}

    results = []
    # cc 7.0, float16: split-K without tl.dot (M = 1 and M = 8 tiles), act-order gather, 8-bit; its reduce;
    # the dequantize kernel of the cuBLAS path; the grouped MoE kernel.
    results.append(compile_one("splitk_m1_g128", quant_matmul_kernel, 70, mm_ptrs("*fp16", "*fp32"),
                               mm_cx(4, 0, False, True, 1, 64, 128, True), 4, 1))
    results.append(compile_one("splitk_m8_actorder", quant_matmul_kernel, 70, mm_ptrs("*fp16", "*fp16"),
                               mm_cx(4, 2, False, False, 8, 32, 128, True), 4, 1))
    results.append(compile_one("splitk_m2_int8", quant_matmul_kernel, 70, mm_ptrs("*fp16", "*fp32"),
                               mm_cx(8, 0, False, True, 2, 64, 64, True), 4, 1))
    # The GEMV: one group per tile (g128, 16 words), per-word groups (32 words); M = 1, 4 and 16; 8-bit.
    results.append(compile_one("gemv_m1_g128", quant_gemv_kernel, 70, gemv_ptrs("*fp16", "*fp32"),
                               gemv_cx(4, True, True, 1, 32, 16, True), 4, 1))
    results.append(compile_one("gemv_m4_perword", quant_gemv_kernel, 70, gemv_ptrs("*fp16", "*fp32"),
                               gemv_cx(4, False, True, 4, 16, 32, True), 4, 1))
    results.append(compile_one("gemv_m16_out", quant_gemv_kernel, 70, gemv_ptrs("*fp16", "*fp16"),
                               gemv_cx(4, True, False, 16, 8, 16, True), 4, 1))
    results.append(compile_one("gemv_m2_int8", quant_gemv_kernel, 70, gemv_ptrs("*fp16", "*fp32"),
                               gemv_cx(8, False, True, 2, 16, 32, True), 4, 1))
    results.append(compile_one("splitk_reduce", splitk_reduce_kernel, 70, {"partial_ptr": "*fp32", "bias_ptr": "*fp16", "out_ptr": "*fp16"},
                               dict(SPLIT_K=8, HAS_BIAS=True, CLAMP_FP16=True, ROUND=0, BLOCK=1024), 4, 1))
    deq_ptrs = {"qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*i32", "out_ptr": "*fp16"}
    results.append(compile_one("dequantize", dequantize_kernel, 70, deq_ptrs,
                               dict(BITS=4, HAS_ZEROS=True, GROUP_MODE=0, BLOCK_N=32, BLOCK_K=64), 4, 1))
    moe_ptrs = {"a_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*i32", "c_ptr": "*fp16",
                "topk_weights_ptr": "*fp32", "sorted_pair_ids_ptr": "*i32", "tile_expert_ids_ptr": "*i32",
                "num_pairs_post_padded_ptr": "*i32"}
    moe_cx = dict(TOP_K_DIV=8, MUL_ROUTED_WEIGHT=False, BITS=4, HAS_ZEROS=True, GROUP_MODE=0, IEEE_FP32=False,
                  CLAMP_FP16=True, ONE_DOT=False, PTX_DEQ=False, ASM=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
    results.append(compile_one("moe_grouped", grouped_quant_gemm_kernel, 70, moe_ptrs, moe_cx, 4, 1))
    # cc 9.0, bfloat16: split-K with tl.dot on 16-row tiles, the 128 x 128 tiled GEMM, the MoE kernel.
    results.append(compile_one("splitk_dot_m16", quant_matmul_kernel, 90, mm_ptrs("*bf16", "*fp32"),
                               mm_cx(4, 0, True, True, 16, 64, 128, False), 4, 3))
    results.append(compile_one("splitk_dot_m16_g32", quant_matmul_kernel, 90, mm_ptrs("*bf16", "*fp32"),
                               mm_cx(4, 1, True, True, 16, 64, 128, False), 4, 3))
    results.append(compile_one("tiled_m128", quant_matmul_kernel, 90, mm_ptrs("*bf16", "*bf16"),
                               mm_cx(4, 0, True, False, 128, 128, 128, False), 8, 3))
    results.append(compile_one("gemv_m1_g128", quant_gemv_kernel, 90, gemv_ptrs("*bf16", "*fp32"),
                               gemv_cx(4, True, True, 1, 32, 16, False), 4, 1))
    results.append(compile_one("gemv_m4_perword", quant_gemv_kernel, 90, gemv_ptrs("*bf16", "*fp32"),
                               gemv_cx(4, False, True, 4, 16, 32, False), 4, 1))
    # The GEMV's register prefetch (quant_linear.GEMV_PREFETCH), at the planned M = 1 tile and a 128 x 8 one,
    # specialized as a launch on Llama-3.1-8B shapes is (unit strides, 16-byte aligned pointers and sizes).
    launch = dict(aligned=("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "K", "kw_total", "words_per_group",
                           "words_per_split", "stride_qn", "stride_sn", "stride_zn"),
                  unit=("M", "stride_xk", "stride_qk", "stride_sg", "stride_zg", "stride_on"))
    pf = dict(PREFETCH=True, EVEN_K=True, ASM=True, HAS_BIAS=False)
    results.append(compile_one("gemv_m1_prefetch", quant_gemv_kernel, 90, gemv_ptrs("*bf16", "*fp32"),
                               gemv_cx(4, True, True, 1, 32, 16, False, **pf), 1, 1, **launch))
    results.append(compile_one("gemv_m1_128x8_prefetch", quant_gemv_kernel, 90, gemv_ptrs("*bf16", "*fp32"),
                               gemv_cx(4, True, True, 1, 128, 8, False, **pf), 1, 1, **launch))
    # The tensor-core GEMV (cc >= 8.0 only; its PTX dequantization in bf16x2 and f16x2).
    for act in ("*bf16", "*fp16"):
        results.append(compile_one("dot_m16_" + act[1:], quant_dot_kernel, 90, gemv_ptrs(act, "*fp32"),
                                   dict(HAS_ZEROS=True, HAS_BIAS=True, PARTIAL=True, CLAMP_FP16=act == "*fp16",
                                        ASM=True, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=8), 4, 4))
    bf = {n: ("*bf16" if t == "*fp16" else t) for n, t in moe_ptrs.items()}
    results.append(compile_one("moe_grouped", grouped_quant_gemm_kernel, 90, bf, dict(moe_cx, CLAMP_FP16=False), 4, 2))
    results.append(compile_one("moe_grouped_ptx", grouped_quant_gemm_kernel, 90, bf,
                               dict(moe_cx, CLAMP_FP16=False, PTX_DEQ=True, ASM=True), 4, 2))
    # The large-M tensor-core GEMM (quant_gemm_tc.py): the planned tiles, bfloat16, 4-bit with zeros; the largest
    # with the other unpack mode, with the weight tile in shared memory, 8-bit weights and float16 x (its clamp);
    # float32 x never takes this kernel.
    from tokenmill.kernels.triton.quant_gemm_tc import TC_TILES, quant_gemm_tc_kernel
    tc_ptrs = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    f16 = {n: ("*fp16" if t == "*bf16" else t) for n, t in tc_ptrs.items()}
    big = TC_TILES[-1][1]
    other = "index" if big.unpack == "gather" else "gather"
    tc_variants = [(f"tc_{t.block_m}x{t.block_n}x{t.block_k}", tc_ptrs, 4, False, t) for _, t in TC_TILES]
    tc_variants += [("tc_" + other, tc_ptrs, 4, False, big._replace(unpack=other)),
                    ("tc_shared", tc_ptrs, 4, False, big._replace(unpack="gather", operand="shared")),
                    ("tc_int8", tc_ptrs, 8, False, big), ("tc_fp16", f16, 4, True, big)]
    for name, ptrs, bits, clamp, t in tc_variants:
        results.append(compile_one(name, quant_gemm_tc_kernel, 90, ptrs,
                                   dict(BITS=bits, HAS_ZEROS=True, HAS_BIAS=False, CLAMP_FP16=clamp, IEEE=False,
                                        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8,
                                        NUM_STAGES=t.stages, GATHER=t.unpack == "gather",
                                        W_IN_REGS=t.operand == "register"), t.warps, t.stages,
                                   aligned=("x_ptr", "qw_ptr", "out_ptr", "stride_xm", "stride_qn", "stride_om", "K",
                                            "N"),
                                   unit=("stride_xk", "stride_qw", "stride_sg", "stride_zg", "stride_on")))
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_quant_kernels_compile_for_sm70_and_sm90_without_a_gpu(compiled_kernels):
    results = compiled_kernels(__name__)  # SCRIPT, run with the other compile checks
    assert [(r["kernel"], r["cc"]) for r in results] == [
        ("splitk_m1_g128", 70), ("splitk_m8_actorder", 70), ("splitk_m2_int8", 70), ("gemv_m1_g128", 70),
        ("gemv_m4_perword", 70), ("gemv_m16_out", 70), ("gemv_m2_int8", 70), ("splitk_reduce", 70),
        ("dequantize", 70), ("moe_grouped", 70), ("splitk_dot_m16", 90), ("splitk_dot_m16_g32", 90), ("tiled_m128", 90),
        ("gemv_m1_g128", 90), ("gemv_m4_perword", 90), ("gemv_m1_prefetch", 90), ("gemv_m1_128x8_prefetch", 90),
        ("dot_m16_bf16", 90), ("dot_m16_fp16", 90), ("moe_grouped", 90),
        ("moe_grouped_ptx", 90), ("tc_64x64x32", 90), ("tc_128x128x32", 90), ("tc_gather", 90), ("tc_shared", 90),
        ("tc_int8", 90), ("tc_fp16", 90),
    ]
    for r in results:
        assert r["ptx_target"] == ["sm_70" if r["cc"] == 70 else "sm_90a"], r
        assert r["cubin_bytes"] > 0, r
        # Shared memory per block: V100 allows 96 KiB, H100/H200 227 KiB.
        assert r["shared"] <= (96 if r["cc"] == 70 else 227) * 1024, r
        # The planned tiles fit the register file: no spills to local memory (a spill in a memory-bound
        # kernel costs more HBM traffic than the 4-bit weights save).
        assert r["spill_bytes"] == 0 and r["registers"] <= 255, r

