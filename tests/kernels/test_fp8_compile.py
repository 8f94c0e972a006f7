"""Compile the FP8 Triton kernels for sm_70 (V100), sm_89 (Ada) and sm_90 (H100/H200) without a GPU.

Same mechanism as test_triton_compile_sm70.py: `triton.compile` with an explicit GPUTarget (LLVM to PTX,
the wheel's ptxas to a cubin), in a subprocess without TRITON_INTERPRET. sm_70 gets what runs there:
the weight-only GEMM (fp16 activations, uint8 weight bits decoded by integer ops, per-channel and
128x128 block scales, both the FMA and the tl.dot variant), the split-K reduction and the dequantize
kernel; its PTX must contain no FP8 conversion (`e4m3`). sm_89 / sm_90 get the W8A8 GEMM with fp8
`tl.dot` (block scales, and per-token x per-channel), which must reach the tensor cores with e4m3
operands (`mma.sync` on sm_89, `wgmma` on sm_90a for 128-row tiles), and the activation quantization kernel.
The FMA GEMV (fp8_gemv.py) at its planned tiles: integer decoding on sm_70 / sm_80 (no FP8 instruction in its
PTX), the PTX FP8 conversion on sm_89 / sm_90 (W8A8 and weight-only); ptxas -v must report no spills.
"""

from __future__ import annotations

import textwrap


SCRIPT = textwrap.dedent(
    """
    import json
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from tokenmill.kernels.triton.fp8_gemm import fp8_matmul_kernel, fp8_dequantize_kernel
    from tokenmill.kernels.triton.splitk import splitk_reduce_kernel
    from tokenmill.kernels.triton.fp8_quant import quantize_fp8_kernel
    from tokenmill.kernels.triton.fp8_gemm import FP8_GEMV_TILES
    from tokenmill.kernels.triton.fp8_gemv import fp8_gemv_kernel
    from compile_helpers import compile_with_ptxas

    def sig_of(kernel, pointers, constexprs):
        sig = {name: pointers.get(name, "i32") for name in kernel.arg_names}
        sig.update({name: "constexpr" for name in constexprs})
        return sig

    # What Triton's launcher specializes at run time for contiguous, 16-byte aligned tensors (the usual case):
    # pointers and leading dims divisible by 16, unit strides as constants. Without it no load is vectorized
    # and the K loop is not pipelined, so the shared-memory check below would not see the real footprint.
    ALIGNED = ("a_ptr", "b_ptr", "a_scale_ptr", "b_scale_ptr", "bias_ptr", "out_ptr", "partial_ptr", "scale_ptr",
               "x_ptr", "q_ptr", "s_ptr", "N", "K", "stride_am", "stride_bn", "stride_om", "stride_os")
    UNIT = ("stride_ak", "stride_bk", "stride_on", "stride_xk", "stride_qk", "stride_ok")

    def build(name, kernel, cc, pointers, constexprs, warps=4, stages=1):
        constexprs = dict(constexprs, **{n: 1 for n in UNIT if n in kernel.arg_names})
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED if n in kernel.arg_names}
        src = triton.compiler.ASTSource(fn=kernel, signature=sig_of(kernel, pointers, constexprs), constexprs=constexprs,
                                        attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages})
        ptx = k.asm["ptx"]
        return dict(kernel=name, cc=cc, ptx_target=[l.split()[1] for l in ptx.splitlines() if l.startswith(".target")],
                    fp8_cvt="e4m3" in ptx, mma="wgmma" in ptx or "mma.sync" in ptx,
                    stages_in_smem=max([int(s) for s in re.findall(r"memdesc<(\\d+)x\\d+x\\d+x", k.asm["ttgir"])], default=1),
                    cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared)

    def gemm(a, b, out, a_fp8, a_scale, b_scale, use_dot, bm, bn, bk, partial=False):
        ptrs = dict(a_ptr=a, b_ptr=b, a_scale_ptr="*fp32", b_scale_ptr="*fp32", bias_ptr="*fp16", out_ptr=out)
        cx = dict(A_FP8=a_fp8, A_SCALE=a_scale, B_SCALE=b_scale, HAS_BIAS=True, USE_DOT=use_dot, IEEE_FP32=False,
                  PARTIAL=partial, CLAMP_FP16=out == "*fp16", ROUND=1 if out == "*fp16" else 2,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
        return ptrs, cx

    results = []
    # sm_70: weight-only. (split-K FMA tile for decode, block scales; tiled tl.dot, per-channel.)
    ptrs, cx = gemm("*fp16", "*u8", "*fp32", False, 0, 3, False, 8, 64, 16, partial=True)
    results.append(build("w8a16_fma_block", fp8_matmul_kernel, 70, ptrs, cx))
    ptrs, cx = gemm("*fp16", "*u8", "*fp16", False, 0, 2, True, 16, 64, 128)
    results.append(build("w8a16_dot_channel", fp8_matmul_kernel, 70, ptrs, cx))
    cx = dict(SPLIT_K=4, HAS_BIAS=True, CLAMP_FP16=True, ROUND=1, BLOCK=1024)
    results.append(build("splitk_reduce", splitk_reduce_kernel, 70,
                         dict(partial_ptr="*fp32", bias_ptr="*fp16", out_ptr="*fp16"), cx))
    cx = dict(B_SCALE=3, ROUND=1, BLOCK_N=32, BLOCK_K=64)
    results.append(build("dequantize_block", fp8_dequantize_kernel, 70,
                         dict(b_ptr="*u8", scale_ptr="*fp32", out_ptr="*fp16"), cx))
    # sm_89 / sm_90: W8A8 with fp8 dots, and the activation quantization.
    for cc in (89, 90):
        ptrs, cx = gemm("*fp8e4nv", "*fp8e4nv", "*bf16", True, 3, 3, True, 128, 128, 128)
        results.append(build("w8a8_block", fp8_matmul_kernel, cc, ptrs, cx, warps=8, stages=3))
        ptrs, cx = gemm("*fp8e4nv", "*fp8e4nv", "*fp32", True, 2, 2, True, 16, 64, 128, partial=True)
        results.append(build("w8a8_channel_splitk", fp8_matmul_kernel, cc, ptrs, cx, stages=3))
        cx = dict(STATIC=False, LOOP=False, GROUPS=16, BLOCK_K=128)
        results.append(build("quantize_group128", quantize_fp8_kernel, cc,
                             dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"), cx))
        cx = dict(STATIC=False, LOOP=True, GROUPS=1, BLOCK_K=1024)
        results.append(build("quantize_token", quantize_fp8_kernel, cc,
                             dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"), cx))
    # The GEMV at its planned tiles: (name, cc, x pointer, BLOCK_M, HW_CVT, PREFETCH); W8A8 x is int32 words of
    # e4m3 codes.
    gemvs = [("gemv_w8a16", 70, "*fp16", 1, False, False), ("gemv_w8a16", 80, "*bf16", 2, False, False),
             ("gemv_w8a8", 89, "*i32", 1, True, False), ("gemv_w8a8", 90, "*i32", 1, True, False),
             ("gemv_w8a8", 90, "*i32", 2, True, False), ("gemv_w8a16", 90, "*bf16", 1, True, True)]
    for name, cc, x, bm, hw, pf in gemvs:
        bn, kw, warps, _ = FP8_GEMV_TILES[bm]
        cx = dict(A_FP8=x == "*i32", A_SCALE=2 if x == "*i32" else 0, B_SCALE=2, EVEN_K=True, HAS_BIAS=False,
                  PARTIAL=True, CLAMP_FP16=False, ROUND=0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_KW=kw, HW_CVT=hw,
                  PREFETCH=pf, stride_xk=1, stride_wk=1, stride_xs=1, stride_ws=1, stride_on=1)
        r = compile_with_ptxas(name, fp8_gemv_kernel, cc, dict(x_ptr=x, w_ptr="*i32", x_scale_ptr="*fp32",
                               w_scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*fp32"), cx, warps, 1, "e4m3",
                               ("x_ptr", "w_ptr", "out_ptr", "N", "kw_total", "words_per_split", "stride_xm",
                                "stride_wn", "stride_os", "stride_om"))
        results.append(dict(r, fp8_cvt=r.pop("ptx_has_marker"), hw=hw))
    print(json.dumps(results))
    """
)


def test_fp8_kernels_compile_for_sm70_sm89_sm90_without_a_gpu(compiled_kernels):
    results = compiled_kernels(__name__)  # SCRIPT, run with the other compile checks
    per_cc = ["w8a8_block", "w8a8_channel_splitk", "quantize_group128", "quantize_token"]
    assert [(r["kernel"], r["cc"]) for r in results] == [
        ("w8a16_fma_block", 70), ("w8a16_dot_channel", 70), ("splitk_reduce", 70), ("dequantize_block", 70),
    ] + [(name, cc) for cc in (89, 90) for name in per_cc] + [
        ("gemv_w8a16", 70), ("gemv_w8a16", 80), ("gemv_w8a8", 89), ("gemv_w8a8", 90), ("gemv_w8a8", 90),
        ("gemv_w8a16", 90)]
    want_target = {70: "sm_70", 80: "sm_80", 89: "sm_89", 90: "sm_90a"}
    for r in results:
        assert r["ptx_target"] == [want_target[r["cc"]]], r
        assert r["cubin_bytes"] > 0, r
        assert r["shared"] <= {70: 96, 80: 163, 89: 99, 90: 227}[r["cc"]] * 1024, r
        if r["cc"] == 70:
            assert not r["fp8_cvt"], r  # no FP8 instruction on the V100 path
        if r["kernel"].startswith("w8a8"):
            assert r["fp8_cvt"] and r["mma"], r  # fp8 operands on the tensor cores (mma.sync e4m3 / wgmma)
            assert r["stages_in_smem"] >= 2, r  # the K loop is software-pipelined (multi-buffered in shared memory)
        if r["kernel"].startswith("quantize"):
            assert not r["fp8_cvt"], r  # bit-op encoding, the same code the interpreter tests
        if r["kernel"].startswith("gemv"):
            assert r["fp8_cvt"] == r["hw"] == (r["cc"] >= 89), r  # PTX conversion on cc >= 8.9 only
            assert r["spill_bytes"] == 0, r
