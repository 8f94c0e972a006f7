"""Compile the fused-MoE helper kernels (sort, routing, top-k sum) for sm_70 and a grouped GEMM tile of the
default table for sm_90, without a GPU (compile_helpers: triton.compile for an explicit target, then ptxas -v).

The sort and routing kernels hold [CHUNK, SUB] / [ROWS, E] tiles in registers: ptxas must take them without
spilling at the launched sizes (a spill would be a silent slowdown on the decode path).
"""

from __future__ import annotations

import textwrap


SCRIPT = textwrap.dedent(
    """
    import json
    from compile_helpers import compile_with_ptxas
    from tokenmill.kernels.triton import fused_moe as fm, moe_align as ma, moe_routing as mr

    out = []
    ptrs = {"ids_ptr": "*i64", "counts_ptr": "*i32", "ranks_ptr": "*i32", "base_ptr": "*i32", "sorted_ptr": "*i32",
            "tile_expert_ptr": "*i32", "num_post_ptr": "*i32"}
    warps = max(4, ma.CHUNK // 64)
    out.append(compile_with_ptxas("align_count", ma.align_count_kernel, 70, ptrs,
                                  dict(E_PAD=128, CHUNK=ma.CHUNK, SUB=ma.SUB), warps, 1))
    out.append(compile_with_ptxas("align_scatter_fused", ma.align_scatter_kernel, 70, ptrs,
                                  dict(FUSED=True, BLOCK_M=16, E_PAD=128, CHUNK=ma.CHUNK, SUB=ma.SUB, ROWS=1,
                                       TILE_BLOCK=ma.TILE_BLOCK), warps, 1))
    out.append(compile_with_ptxas("topk_softmax", mr.topk_softmax_kernel, 70,
                                  {"logits_ptr": "*fp16", "weights_ptr": "*fp32", "ids_ptr": "*i64"},
                                  dict(TOP_K=8, K_PAD=8, RENORMALIZE=True, USE_LIBDEVICE=True, E_PAD=128, ROWS=16), 4, 1))
    out.append(compile_with_ptxas("moe_sum", fm.moe_sum_kernel, 70, {"x_ptr": "*fp32", "out_ptr": "*fp16"},
                                  dict(TOP_K=8, CLAMP_FP16=True, BLOCK_H=1024), 4, 1))
    _, c13, _ = fm._TABLE[0]
    out.append(compile_with_ptxas(
        "grouped_gemm_decode_w13", fm.grouped_gemm_kernel, 90,
        {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16", "topk_weights_ptr": "*fp32",
         "sorted_pair_ids_ptr": "*i32", "tile_expert_ids_ptr": "*i32", "num_pairs_post_padded_ptr": "*i32"},
        dict(TOP_K_DIV=8, HAS_BIAS=True, MUL_ROUTED_WEIGHT=False, IEEE_FP32=False, BLOCK_M=c13.block_m,
             BLOCK_N=c13.block_n, BLOCK_K=c13.block_k, GROUP_M=4), c13.num_warps, c13.num_stages))
    print(json.dumps(out))
    """
)


def test_moe_kernels_compile_without_spills(compiled_kernels):
    results = compiled_kernels(__name__)  # SCRIPT, run with the other compile checks
    assert [r["kernel"] for r in results] == ["align_count", "align_scatter_fused", "topk_softmax", "moe_sum",
                                              "grouped_gemm_decode_w13"]
    for r in results:
        assert r["ptx_target"] == (["sm_70"] if r["cc"] == 70 else ["sm_90a"]), r
        assert r["spill_bytes"] == 0, r
        assert r["shared"] <= (96 if r["cc"] == 70 else 227) * 1024, r
