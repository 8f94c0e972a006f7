"""Compile the FP8 Triton kernels for sm_70 (V100), sm_89 (Ada) and sm_90 (H100/H200) without a GPU.

Same mechanism as test_triton_compile_sm70.py: `triton.compile` with an explicit GPUTarget (LLVM to PTX,
the wheel's ptxas to a cubin), in a subprocess without TRITON_INTERPRET. sm_70 gets what runs there:
the weight-only GEMM (fp16 activations, uint8 weight bits decoded by integer ops, per-channel and
128x128 block scales, both the FMA and the tl.dot variant), the split-K reduction and the dequantize
kernel; its PTX must contain no FP8 conversion (`e4m3`). sm_89 / sm_90 get the W8A8 GEMM with fp8
`tl.dot` (block scales, and per-token x per-channel), which must reach the tensor cores with e4m3
operands (`mma.sync` on sm_89, `wgmma` on sm_90a for 128-row tiles), and the activation quantization kernel.
"""

from __future__ import annotations

import textwrap

from compile_helpers import compile_in_subprocess
from optional_deps import require

SCRIPT = textwrap.dedent(
    """
    import json
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from tokenmill.kernels.triton.fp8_gemm import fp8_matmul_kernel, fp8_dequantize_kernel
    from tokenmill.kernels.triton.splitk import splitk_reduce_kernel
    from tokenmill.kernels.triton.fp8_quant import quantize_fp8_kernel

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
    print(json.dumps(results))
    """
)


def test_fp8_kernels_compile_for_sm70_sm89_sm90_without_a_gpu():
    require("triton")
    results = compile_in_subprocess(SCRIPT)
    per_cc = ["w8a8_block", "w8a8_channel_splitk", "quantize_group128", "quantize_token"]
    assert [(r["kernel"], r["cc"]) for r in results] == [
        ("w8a16_fma_block", 70), ("w8a16_dot_channel", 70), ("splitk_reduce", 70), ("dequantize_block", 70),
    ] + [(name, cc) for cc in (89, 90) for name in per_cc]
    want_target = {70: "sm_70", 89: "sm_89", 90: "sm_90a"}
    for r in results:
        assert r["ptx_target"] == [want_target[r["cc"]]], r
        assert r["cubin_bytes"] > 0, r
        assert r["shared"] <= (96 if r["cc"] == 70 else 99 if r["cc"] == 89 else 227) * 1024, r
        if r["cc"] == 70:
            assert not r["fp8_cvt"], r  # no FP8 instruction on the V100 path
        if r["kernel"].startswith("w8a8"):
            assert r["fp8_cvt"] and r["mma"], r  # fp8 operands on the tensor cores (mma.sync e4m3 / wgmma)
            assert r["stages_in_smem"] >= 2, r  # the K loop is software-pipelined (multi-buffered in shared memory)
        if r["kernel"].startswith("quantize"):
            assert not r["fp8_cvt"], r  # bit-op encoding, the same code the interpreter tests
