"""Compile the Triton kernels for sm_70 (V100) and sm_90 (H100/H200) without a GPU.

The fp8 KV-cache variants (uint8 cache bits, integer encode / decode) are compiled for sm_70 too:
no FP8 instruction is needed there.

triton.compile with an explicit GPUTarget needs no driver: the NVIDIA backend
lowers to PTX with LLVM and assembles a cubin with the ptxas bundled in the
triton wheel. It runs in a subprocess because the test session may have set
TRITON_INTERPRET=1 (which turns every @triton.jit into an interpreted function
that cannot be compiled).
"""

from __future__ import annotations

import textwrap


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from tokenmill.kernels.triton.activation import act_and_mul_kernel
    from tokenmill.kernels.triton.attention_config import choose_launch_config
    from tokenmill.kernels.triton.merge_splits import merge_splits_kernel
    from tokenmill.kernels.triton.paged_attention import paged_attention_kernel
    from tokenmill.kernels.triton.reshape_and_cache import reshape_and_cache_kernel
    from tokenmill.kernels.triton.rms_norm import rms_norm_kernel
    from tokenmill.kernels.triton.rotary import rotary_kernel
    from tokenmill.platforms.cuda import triton_launch_settings

    def sig_of(kernel, pointers, floats, constexprs):
        sig = {}
        for name in kernel.arg_names:
            sig[name] = pointers.get(name) or ("fp32" if name in floats else "i32")
        for name in constexprs:
            sig[name] = "constexpr"
        return sig

    results = []
    for cc in (70, 90):
        stages = triton_launch_settings((cc // 10, cc % 10))["num_stages"]
        # KV write: fp16 cache on sm_70; fp8 caches (uint8 bits, integer encode) on both.
        for name, kv_fp8, act in (("kv_write", 0, "*fp16"), ("kv_write_e4m3", 1, "*fp16" if cc == 70 else "*bf16"),
                                  ("kv_write_e5m2", 2, "*fp16" if cc == 70 else "*bf16")):
            if cc == 90 and kv_fp8 == 0:
                continue
            cx = dict(BLOCK_SIZE=16, BLOCK_H=8, HEAD_DIM_PAD=128, KV_FP8=kv_fp8)
            ptrs = {"key_ptr": act, "value_ptr": act, "kv_cache_ptr": "*u8" if kv_fp8 else act, "slot_mapping_ptr": "*i64"}
            src = triton.compiler.ASTSource(fn=reshape_and_cache_kernel, signature=sig_of(reshape_and_cache_kernel, ptrs, ("k_scale", "v_scale"), cx), constexprs=cx)
            k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})
            results.append(dict(kernel=name, cc=cc, ptx_target=[l.split()[1] for l in k.asm["ptx"].splitlines() if l.startswith(".target")],
                                cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared))
        if cc == 70:
            cx = dict(SPLITS_PAD=4, HEAD_DIM_PAD=128, USE_SINKS=True)
            ptrs = {"out_ptr": "*fp16", "partial_ptr": "*fp32", "lse_ptr": "*fp32", "sinks_ptr": "*fp32"}
            src = triton.compiler.ASTSource(fn=merge_splits_kernel, signature=sig_of(merge_splits_kernel, ptrs, (), cx), constexprs=cx)
            k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})
            results.append(dict(kernel="merge_splits", cc=cc, ptx_target=[l.split()[1] for l in k.asm["ptx"].splitlines() if l.startswith(".target")],
                                cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared))
        # Attention, window + softcap on. sm_70 (fp16): decode tiles at head_dim 128 on the
        # split-KV path (16-bit and e4m3 caches), and the largest prefill tiles (head_dim 256);
        # sm_90: prefill tiles at head_dim 128 (fp16), and bf16 decode tiles over an e5m2 cache.
        # The two launches of a mixed step (ROLE 1 decode tiles, ROLE 2 prefill tiles) on both.
        # (Each sm_70 compile takes seconds: its dots unroll into FMAs.)
        shapes = (((1, 128, 4, 0, 0), (1, 128, 4, 1, 0), (512, 256, 1, 0, 0), (1, 128, 1, 0, 1), (512, 128, 1, 0, 2))
                  if cc == 70
                  else ((512, 128, 1, 0, 0), (1, 128, 4, 2, 0), (1, 128, 1, 0, 1), (512, 128, 1, 2, 2),
                        (16384, 128, 1, 0, 0), (512, 128, 1, 1, 0)))
        for max_q, head_dim, splits, kv_fp8, role in shapes:
            act = "*bf16" if cc == 90 and kv_fp8 else "*fp16"
            cfg = choose_launch_config(max_q, 4, head_dim, num_stages=stages, large_tiles=cc == 90)
            # As launched: fp8 decoded by conversion instructions on sm_90 (integer operations on sm_70), bfloat16
            # queries over an fp8 cache dot in float16.
            cx = dict(BLOCK_SIZE=16, BLOCK_Q=cfg.block_q, QPK_PAD=cfg.qpk_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      HEAD_DIM_PAD=cfg.head_dim_pad, USE_WINDOW=True,
                      USE_SOFTCAP=True, USE_SINKS=True, DOT_PREC="tf32", NUM_SPLITS=splits, SPLIT_KV=splits > 1,
                      KV_FP8=kv_fp8, KV_NATIVE=cc == 90 and kv_fp8 > 0, Q_F16=act == "*bf16" and kv_fp8 > 0,
                      HEAVY_FIRST=role != 1, ROLE=role, DECODE_Q=4 if role == 2 else 0)
            ptrs = {"out_ptr": "*fp32" if splits > 1 else act, "lse_ptr": "*fp32", "q_ptr": act,
                    "kv_cache_ptr": "*u8" if kv_fp8 else act, "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                    "query_start_loc_ptr": "*i32", "sinks_ptr": "*fp32"}
            # 16-byte aligned pointers and strides that are multiples of 16, as a launch specializes them for
            # Llama-shaped tensors.
            aligned = ("out_ptr", "q_ptr", "kv_cache_ptr", "block_table_ptr", "stride_q_tok", "stride_q_head",
                       "stride_c_kv", "stride_c_block", "stride_c_slot", "stride_c_head")
            attrs = {(paged_attention_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
            src = triton.compiler.ASTSource(fn=paged_attention_kernel,
                                            signature=sig_of(paged_attention_kernel, ptrs, ("scale", "v_scale", "softcap"), cx),
                                            constexprs=cx, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": cfg.num_warps, "num_stages": stages})
            suffix = ({0: "", 1: "_e4m3", 2: "_e5m2"}[kv_fp8] + {0: "", 1: "_decode_role", 2: "_prefill_role"}[role]
                      + ("_large_tiles" if cfg.block_m == 128 else ""))
            results.append(dict(kernel=f"attention_q{max_q}_d{head_dim}{suffix}", cc=cc,
                                ptx_target=[l.split()[1] for l in k.asm["ptx"].splitlines() if l.startswith(".target")],
                                cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared))
    # sm_75 (T4: 64 KiB of shared memory a block), float16, head_dim 256 (Gemma 3): the prefill tiles for small
    # shared memory and the decode tiles.
    for max_q in (512, 1):
        cfg = choose_launch_config(max_q, 4, 256, num_stages=1, small_shared=True)
        cx = dict(BLOCK_SIZE=16, BLOCK_Q=cfg.block_q, QPK_PAD=cfg.qpk_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  HEAD_DIM_PAD=cfg.head_dim_pad, USE_WINDOW=True, USE_SOFTCAP=True, USE_SINKS=False, DOT_PREC="tf32",
                  NUM_SPLITS=1, SPLIT_KV=False, KV_FP8=0, KV_NATIVE=False, Q_F16=False, HEAVY_FIRST=True, ROLE=0,
                  DECODE_Q=0)
        ptrs = {"out_ptr": "*fp16", "lse_ptr": "*fp32", "q_ptr": "*fp16", "kv_cache_ptr": "*fp16",
                "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "sinks_ptr": "*fp32"}
        src = triton.compiler.ASTSource(fn=paged_attention_kernel, constexprs=cx,
                                        signature=sig_of(paged_attention_kernel, ptrs, ("scale", "v_scale", "softcap"), cx))
        k = triton.compile(src, target=GPUTarget("cuda", 75, 32), options={"num_warps": cfg.num_warps, "num_stages": 1})
        results.append(dict(kernel=f"attention_q{max_q}_d256", cc=75,
                            ptx_target=[l.split()[1] for l in k.asm["ptx"].splitlines() if l.startswith(".target")],
                            cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared))
    # Fused elementwise kernels (RMSNorm, RoPE, gated activations): float16 on sm_70
    # (ROUND=1), bfloat16 on sm_90 (ROUND=2); libdevice math on, no fp fusion (as launched).
    for cc in (70, 90):
        act_ty, rnd = ("*fp16", 1) if cc == 70 else ("*bf16", 2)
        variants = [
            ("rms_norm_add_d4096", rms_norm_kernel, 8, ("inv_n", "eps"),
             dict(HAS_RESIDUAL=True, GEMMA=False, ROUND=rnd, BLOCK_R=1, BLOCK_N=4096)),
            ("rms_norm_gemma_heads_d128", rms_norm_kernel, 4, ("inv_n", "eps"),
             dict(HAS_RESIDUAL=False, GEMMA=True, ROUND=rnd, BLOCK_R=16, BLOCK_N=128)),
            ("rotary_neox_d128", rotary_kernel, 4, (),
             dict(HEAD_SIZE=128, ROT_HALF=64, ROT_HALF_PAD=64, REST_PAD=0, IS_NEOX=True, ROUND=rnd, BLOCK_H=16)),
            ("rotary_gptj_partial_d80", rotary_kernel, 4, (),
             dict(HEAD_SIZE=80, ROT_HALF=16, ROT_HALF_PAD=16, REST_PAD=64, IS_NEOX=False, ROUND=rnd, BLOCK_H=16)),
            ("silu_and_mul", act_and_mul_kernel, 4, (), dict(ACT=0, ROUND=rnd, USE_LIBDEVICE=True, BLOCK_D=1024)),
            ("gelu_tanh_and_mul", act_and_mul_kernel, 4, (), dict(ACT=1, ROUND=rnd, USE_LIBDEVICE=True, BLOCK_D=1024)),
            ("gelu_erf_and_mul", act_and_mul_kernel, 4, (), dict(ACT=2, ROUND=rnd, USE_LIBDEVICE=True, BLOCK_D=1024)),
            ("swiglu_oai_and_mul", act_and_mul_kernel, 4, (),
             dict(ACT=3, ROUND=rnd, USE_LIBDEVICE=True, BLOCK_D=1024, ALPHA=1.702, LIMIT=7.0)),
        ]
        for name, kernel, warps, floats, cx in variants:
            ptrs = {n: act_ty for n in kernel.arg_names if n.endswith("_ptr")}
            ptrs.update({"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"})
            ptrs = {n: t for n, t in ptrs.items() if n in kernel.arg_names}
            src = triton.compiler.ASTSource(fn=kernel, signature=sig_of(kernel, ptrs, floats, cx), constexprs=cx)
            k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "enable_fp_fusion": False})
            results.append(dict(kernel=name, cc=cc, ptx_target=[l.split()[1] for l in k.asm["ptx"].splitlines() if l.startswith(".target")],
                                cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared))
    # MXFP4 expert decode (gpt-oss): fp16 out on sm_70, bf16 on sm_90.
    from tokenmill.kernels.triton.mxfp4_dequant import mxfp4_dequant_kernel

    for cc in (70, 90):
        ptrs = {"blocks_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*fp16" if cc == 70 else "*bf16"}
        cx = dict(BLOCK_B=1024)
        src = triton.compiler.ASTSource(fn=mxfp4_dequant_kernel, signature=sig_of(mxfp4_dequant_kernel, ptrs, (), cx), constexprs=cx)
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})
        results.append(dict(kernel="mxfp4_dequant", cc=cc, ptx_target=[l.split()[1] for l in k.asm["ptx"].splitlines() if l.startswith(".target")],
                            cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared))
    print(json.dumps(results))
    """
)


def test_kernels_compile_for_sm70_and_sm90_without_a_gpu(compiled_kernels):
    results = compiled_kernels(__name__)  # SCRIPT, run with the other compile checks
    elementwise = ["rms_norm_add_d4096", "rms_norm_gemma_heads_d128", "rotary_neox_d128", "rotary_gptj_partial_d80",
                   "silu_and_mul", "gelu_tanh_and_mul", "gelu_erf_and_mul", "swiglu_oai_and_mul"]
    assert [(r["kernel"], r["cc"]) for r in results] == [
        ("kv_write", 70), ("kv_write_e4m3", 70), ("kv_write_e5m2", 70), ("merge_splits", 70), ("attention_q1_d128", 70),
        ("attention_q1_d128_e4m3", 70), ("attention_q512_d256", 70), ("attention_q1_d128_decode_role", 70),
        ("attention_q512_d128_prefill_role", 70), ("kv_write_e4m3", 90), ("kv_write_e5m2", 90),
        ("attention_q512_d128", 90), ("attention_q1_d128_e5m2", 90), ("attention_q1_d128_decode_role", 90),
        ("attention_q512_d128_e5m2_prefill_role", 90), ("attention_q16384_d128_large_tiles", 90),
        ("attention_q512_d128_e4m3", 90), ("attention_q512_d256", 75), ("attention_q1_d256", 75)
    ] + [(name, cc) for cc in (70, 90) for name in elementwise] + [("mxfp4_dequant", 70), ("mxfp4_dequant", 90)]
    for r in results:
        want = {70: "sm_70", 75: "sm_75"}.get(r["cc"], "sm_90a")
        assert r["ptx_target"] == [want], r
        assert r["cubin_bytes"] > 0, r
        # Shared memory per block: V100 allows 96 KiB, T4 64 KiB, H100/H200 227 KiB.
        assert r["shared"] <= {70: 96, 75: 64}.get(r["cc"], 227) * 1024, r
