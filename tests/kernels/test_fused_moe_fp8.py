"""FP8 fused MoE (`kernels/triton/fused_moe_fp8.py`) vs dequantize-then-`fused_experts_reference`.

CPU: the Triton interpreter at tiny shapes, per-expert, per-channel and block scales, float16 and bfloat16.
The reference dequantizes each expert in float32 (`kernels.fp8.dequantize_fp8`) and runs the float32 PyTorch
reference on the same activations. The kernel's products are exact (e4m3 x 16-bit in a float32
accumulator), so it differs only by float32 summation order and by rounding the [gate | up] rows to the
activation dtype before the activation (as the 16-bit path): a relative error of a few units of that dtype's
rounding, u = 2^-8 (bfloat16) / 2^-11 (float16), carried through the down projection. The tolerance is
4u of the output's largest magnitude (atol) and 4u relative (rtol); measured: at most 1.7u of it.
GPU: Qwen3-30B-A3B's expert shapes (E 128, H 2048, I 768, top-8), bfloat16 and the cc-7.0 float16 settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill.kernels.fp8 import (
    dequantize_fp8,
    e4m3_to_float16_table,
    quantize_fp8_block,
    quantize_fp8_per_group,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
)
from tokenmill.kernels.moe_activation import act_and_mul
from tokenmill.kernels.triton import fused_moe_fp8 as f8
from tokenmill.kernels.triton.fused_moe import moe_align_block_size
from tokenmill.layers.fp8_params import Fp8Scheme
from tokenmill.layers.fused_moe import layer as moe_mod
from tokenmill.layers.fused_moe.reference import fused_experts_reference, select_experts

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.fixture
def nan_outputs(monkeypatch):
    """Output buffers start as NaN, so an element the kernels skip fails the comparison."""
    monkeypatch.setattr(f8, "_new_output",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def _quantize(w: torch.Tensor, scheme: str, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense experts [E, N, K] -> (q float8_e4m3fn [E, N, K], scales) in `scheme`'s layout."""
    if scheme == "tensor":
        s = w.abs().amax(dim=(1, 2)) / 448.0
        return (w / s[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn), s
    if scheme == "channel":
        qs = [quantize_fp8_per_row(x) for x in w]
        return torch.stack([q for q, _ in qs]), torch.stack([s.squeeze(-1) for _, s in qs])
    qs = [quantize_fp8_block(x, block) for x in w]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def _dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [E, N, K]: each expert through `kernels.fp8.dequantize_fp8` (on q's device)."""
    return torch.stack([dequantize_fp8(q[e], s[e], block) for e in range(q.shape[0])])


def _experts(e, h, i, scheme, block, seed=0, bias=False, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    (q13, s13), (q2, s2) = _quantize(w13, scheme, block), _quantize(w2, scheme, block)
    biases = (None, None)
    if bias:
        biases = (torch.randn(e, 2 * i, generator=g).to(DEV, dtype), torch.randn(e, h, generator=g).to(DEV, dtype))
    return tuple(t.to(DEV) for t in (q13, s13, q2, s2)), biases


def _reference(x, packed, biases, weights, ids, block, activation="silu"):
    """float32 on x's device, returned on the CPU."""
    q13, s13, q2, s2 = packed
    b13, b2 = (None if b is None else b.float() for b in biases)
    return fused_experts_reference(x.float(), _dequantize(q13, s13, block), _dequantize(q2, s2, block), weights, ids,
                                   activation, b13, b2).cpu()


def _quantized(x, block, static):
    """x after the W8A8 activation quantization (static per-tensor, per 1 x Bk group, or per row), float32."""
    if static is not None:
        return dequantize_fp8(*quantize_fp8_per_tensor(x, static))
    if block is not None:
        return dequantize_fp8(*quantize_fp8_per_group(x, block[1]), (1, block[1]))
    return dequantize_fp8(*quantize_fp8_per_row(x))


def _reference_w8a8(x, packed, biases, weights, ids, block, activation="silu", static=(None, None)):
    """The W8A8 MoE in float32 on x's device, returned on the CPU: x quantized as the kernel does (`_quantized`),
    [gate | up] rounded to x's dtype, activated, quantized again, down projection, routing-weighted top-k sum."""
    q13, s13, q2, s2 = packed
    w13, w2 = _dequantize(q13, s13, block), _dequantize(q2, s2, block)
    b13, b2 = biases
    t, k = ids.shape
    e = ids.reshape(-1)
    rows = _quantized(x, block, static[0]).repeat_interleave(k, dim=0)  # pair p = token * k + slot
    gate_up = torch.zeros(t * k, w13.shape[1], device=x.device)
    for j in e.unique().tolist():  # expert by expert: [pairs, E-sized] weight gathers would not fit at GPU sizes
        p = (e == j).nonzero().squeeze(1)
        gate_up[p] = rows[p] @ w13[j].t() + (0 if b13 is None else b13[j].float())
    inter = _quantized(act_and_mul(gate_up.to(x.dtype), activation), block, static[1])
    down = torch.zeros(t * k, w2.shape[1], device=x.device)
    for j in e.unique().tolist():
        p = (e == j).nonzero().squeeze(1)
        down[p] = inter[p] @ w2[j].t() + (0 if b2 is None else b2[j].float())
    return (down.view(t, k, -1) * weights.float()[..., None]).sum(dim=1).cpu()


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 4 * U[dtype]
    torch.testing.assert_close(out.float().cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


# Shapes: N and K not multiples of the tiles (H 96 with 64-wide tiles), ragged blocks (I 40 with Bk 32), one
# decode token, several tiles per expert. Block sizes stay small so the tiny experts hold several blocks.
@pytest.mark.parametrize("scheme,block", [("tensor", None), ("channel", None), ("block", (32, 32)),
                                          ("block", (1, 32))], ids=["tensor", "channel", "block32", "rows-block32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_dequantized_reference(nan_outputs, scheme, block, dtype):
    e, h, i, t, k = 4, 96, 40, 9, 2
    packed, biases = _experts(e, h, i, scheme, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(DEV, dtype)
    weights, ids = select_experts(torch.randn(t, e, generator=g).to(DEV), k, True)
    out = f8.fused_experts_fp8_triton(x, *packed, weights, ids, block_size=block,
                                      config=f8.Fp8MoeConfig(block_n=32, block_k=32), quantize_activations=False)
    _check(out, _reference(x, packed, biases, weights, ids, block), dtype)


def test_one_token_biases_and_top1(nan_outputs):
    """Decode (one token, most experts empty) with expert biases and swigluoai; top-1 with the default tiles."""
    packed, biases = _experts(4, 64, 32, "channel", None, seed=2, bias=True, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    x = (2 * torch.randn(1, 64, generator=g)).to(DEV, torch.bfloat16)
    weights, ids = select_experts(torch.randn(1, 4, generator=g).to(DEV), 2, True)
    out = f8.fused_experts_fp8_triton(x, *packed, weights, ids, "swigluoai", *biases, quantize_activations=False)
    _check(out, _reference(x, packed, biases, weights, ids, None, "swigluoai"), torch.bfloat16)
    x3 = torch.randn(3, 64, generator=g).to(DEV, torch.float16)
    weights, ids = select_experts(torch.randn(3, 4, generator=g).to(DEV), 1, False)
    out = f8.fused_experts_fp8_triton(x3, *packed, weights, ids, quantize_activations=False)
    _check(out, _reference(x3, packed, (None, None), weights, ids, None), torch.float16)


# W8A8 in the interpreter: its fp8 loads and fp8 dots are exact, so the kernels equal `_reference_w8a8` up to
# float32 summation order (the same 4u tolerance as weight-only). Ragged shapes as above; rows-block32 is
# FusedMoE's layout (per 1 x 32 group activation scales); static: per-tensor input scales.
@pytest.mark.parametrize("scheme,block,static", [("channel", None, False), ("block", (1, 32), False),
                                                 ("tensor", None, True)], ids=["channel", "rows-block32", "static"])
def test_w8a8_matches_quantized_reference(nan_outputs, scheme, block, static):
    e, h, i, t, k = 4, 96, 40, 9, 2
    packed, biases = _experts(e, h, i, scheme, block, bias=scheme == "channel", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(t, h, generator=g)).to(DEV, torch.bfloat16)
    weights, ids = select_experts(torch.randn(t, e, generator=g).to(DEV), k, True)
    scales = (torch.tensor([0.01], device=DEV), torch.tensor([0.002], device=DEV)) if static else (None, None)
    out = f8.fused_experts_fp8_triton(x, *packed, weights, ids, "silu", *biases, block_size=block,
                                      config=f8.Fp8MoeConfig(block_n=32, block_k=32), w13_input_scale=scales[0],
                                      w2_input_scale=scales[1])
    ref = _reference_w8a8(x, packed, biases, weights, ids, block, static=scales)
    _check(out, ref, torch.bfloat16)
    # W8A8 is a different computation from weight-only (the activations' e4m3 rounding, ~2^-5 relative per
    # element): the comparison above can tell them apart.
    assert (out.float().cpu() - _reference(x, packed, biases, weights, ids, block)).abs().max() > 4 * U[
        torch.bfloat16] * ref.abs().max()


def test_w8a8_is_picked_by_capability_and_dtype(monkeypatch):
    """W8A8 needs an effective cc >= 8.9 and 16-bit activations; float32 stays weight-only (exact)."""
    assert f8.uses_w8a8(torch.bfloat16, (9, 0), True) and f8.uses_w8a8(torch.float16, (8, 9), True)
    assert not f8.uses_w8a8(torch.bfloat16, (8, 0), True) and not f8.uses_w8a8(torch.float32, (9, 0), True)
    assert not f8.uses_w8a8(torch.bfloat16, (9, 0), False)
    assert f8.launch_config(8, (9, 0), w8a8=True).block_k == 128
    assert f8.launch_config(16384, (9, 0), w8a8=True).block_n == 128


def test_fused_moe_layer_passes_its_fp8_experts(monkeypatch):
    """FusedMoE's CUDA call (`apply_fp8_experts`, here in the interpreter) on tp rank 1 of 2 with 32 x 32 block
    scales (stored per row, and w2's K shard starting at block 2) equals the layer's CPU path (experts
    dequantized, then the reference), float32."""
    monkeypatch.setattr(moe_mod, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(moe_mod, "get_tensor_model_parallel_world_size", lambda: 2)
    e, h, i = 3, 64, 128
    moe = moe_mod.FusedMoE(e, 2, h, i, renormalize=True, reduce_results=False)
    moe.quantize(Fp8Scheme((32, 32), "dynamic"))
    g = torch.Generator().manual_seed(5)
    for x_id in range(e):
        for p, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            param = moe.w2_weight if p == "w2" else moe.w13_weight
            param.weight_loader(param, torch.randn(*shape, generator=g), p, x_id)  # quantized on the way in
    assert moe.w2_weight_scale.shape == (e, h, 2) and moe.w13_weight_scale.shape == (e, i, 2)
    x, logits = torch.randn(4, h, generator=g), torch.randn(4, e, generator=g)
    weights, ids = select_experts(logits, 2, True)
    out, ref = moe.apply_fp8_experts(x, weights, ids, None), moe(x, logits)
    # float32 on both sides; they differ in where the scale multiplies (each weight vs the K tile's sum)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("enabled", [False, True])
def test_fused_moe_layer_asks_w8a8_when_the_checkpoint_quantizes_activations(monkeypatch, enabled):
    """With FP8_EXPERTS_W8A8 (on by default since its H200 run), dynamic and static checkpoints ask
    `kernels.fused_experts_fp8` for W8A8 (the kernel then checks the device and dtype: `uses_w8a8`), weight-only
    ones do not; off, none does. Block scales go as per-row (1, Bk) blocks."""
    from tokenmill import kernels

    assert moe_mod.FP8_EXPERTS_W8A8 is True  # the default
    monkeypatch.setattr(moe_mod, "FP8_EXPERTS_W8A8", enabled)
    calls = []
    monkeypatch.setattr(kernels, "fused_experts_fp8", lambda x, *a, **kw: calls.append(kw) or x)
    x, weights, ids = torch.zeros(1, 64), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64)
    for block, acts in (((32, 32), "dynamic"), (None, "static"), (None, None)):
        moe = moe_mod.FusedMoE(2, 1, 64, 32, renormalize=False, reduce_results=False)
        moe.quantize(Fp8Scheme(block, acts))
        moe.apply_fp8_experts(x, weights, ids, None)
    assert [(c["quantize_activations"], c["block_size"]) for c in calls] == [(enabled, (1, 32)), (enabled, None),
                                                                             (False, None)]


def test_benchmark_config_dummy_experts(tmp_path, monkeypatch):
    """A tiny version of benchmarks/configs/qwen3-30b-a3b-fp8.json (Qwen3-30B-A3B-FP8's quantization_config:
    fp8 e4m3, dynamic, 128 x 128 blocks) loads dummy FP8 experts on the CPU (kept in FP8 here, as on a GPU), and
    the kernel on them equals the layer's CPU path."""
    from tokenmill.config import EngineArgs
    from tokenmill.model_loader import get_model
    from tokenmill.model_loader import loader as loader_mod

    raw = json.loads((Path(__file__).parents[2] / "benchmarks/configs/qwen3-30b-a3b-fp8.json").read_text())
    raw.update(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=256,
               bos_token_id=1, eos_token_id=2, max_position_embeddings=128)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    monkeypatch.setattr(loader_mod, "dequantize_layers", lambda model: 0)
    cfg = EngineArgs(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True).create_engine_config()
    experts = get_model(cfg.model_config, "cpu", "float32").model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w2_weight_scale.shape == (4, 256, 1)
    assert experts.w13_weight_scale.shape == (4, 256, 2) and experts.quant.block_size == (128, 128)
    g = torch.Generator().manual_seed(6)
    x, logits = torch.randn(3, 256, generator=g), torch.randn(3, 4, generator=g)
    weights, ids = select_experts(logits, 2, True)
    out, ref = experts.apply_fp8_experts(x, weights, ids, None), experts(x, logits)
    assert ref.abs().max() > 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_cc70_settings_decode_every_code_exactly(monkeypatch):
    """The cc-7.0 launch (as TOKENMILL_FORCE_CC70=1 picks it: float16, 32 x 32 weight tiles, one stage) on
    identity activations returns the weight itself: every finite e4m3 code decodes to `e4m3_to_float16_table`'s
    value, bit for bit (the NaN codes 0x7F / 0xFF would spread through the dot's zero products; replaced by 0)."""
    monkeypatch.setattr(f8, "device_facts", lambda device: ((7, 0), 80))
    cfg = f8.launch_config(32, (7, 0))
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages) == (16, 32, 32, 1)
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0
    bits = codes.to(torch.uint8).view(1, 8, 32)  # one expert, N 8, K 32
    x = torch.eye(32, dtype=torch.float16, device=DEV)  # token p routed to expert 0: row p of C is W[:, p]
    ids = torch.zeros(32, 1, dtype=torch.int64, device=DEV)
    c = torch.full((32, 8), float("nan"), dtype=torch.float16, device=DEV)
    scales = f8.expert_scales(bits, torch.ones(1, device=DEV), None, "w")
    f8.grouped_fp8_gemm(x, bits.to(DEV), scales, None, c, None, moe_align_block_size(ids, 16, 1), 1, cfg)
    assert torch.equal(c.t().cpu(), e4m3_to_float16_table()[codes.long()].view(8, 32))


def test_launch_table_and_overrides():
    assert f8.launch_config(8, (9, 0)).block_m == 16  # one decode token at top-8
    assert f8.launch_config(1024, (9, 0)).block_m == 16
    assert f8.launch_config(2048, (9, 0)).block_m == 32
    assert f8.launch_config(16384, (9, 0)).block_m == 64  # 2048 tokens at top-8
    assert f8.launch_config(4096, (7, 0)).block_m == 32
    cfg = f8.launch_config(8, (9, 0), f8.Fp8MoeConfig(block_n=128, num_warps=8))
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps) == (16, 128, 128, 8)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        f8.launch_config(8, (9, 0), f8.Fp8MoeConfig(block_k=48))


def test_bad_inputs_are_refused():
    (q13, s13, q2, s2), _ = _experts(2, 64, 32, "channel", None)
    weights, ids = torch.ones(1, 1, device=DEV), torch.zeros(1, 1, dtype=torch.int64, device=DEV)
    x = torch.zeros(1, 64, device=DEV)
    with pytest.raises(ValueError, match="do not fit hidden size 96"):
        f8.fused_experts_fp8_triton(torch.zeros(1, 96, device=DEV), q13, s13, q2, s2, weights, ids)
    with pytest.raises(ValueError, match=r"Scales of FP8 experts w13 \[2, 64, 64\] must be"):
        f8.fused_experts_fp8_triton(x, q13, s13[:, :3], q2, s2, weights, ids)
    with pytest.raises(ValueError, match=r"must be \[2, 1, 1\]"):
        f8.fused_experts_fp8_triton(x, q13, s13, q2, s2, weights, ids, block_size=(128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        f8.fused_experts_fp8_triton(x, q13.float(), s13, q2, s2, weights, ids)


# GPU W8A8 bound: the fp8 MMA truncates inside each 128-deep partial sum (test_fp8_gemm.py's E_ACC_FP8_MMA, 2^-8 of
# the output), and its [gate | up] rows, a few 2^-10 off the reference's, round to other bfloat16 values at times,
# which now and then moves an intermediate element to the next e4m3 value (2^-4 of it) before w2. Simulated on
# the CPU at these sizes ([gate | up] perturbed by 2^-10 relative noise, output rounded to bfloat16): 0.2-0.8% of
# the largest output, while W8A8 and weight-only differ by 4-5%. Bound: 4u (the output's bfloat16 rounding, as
# weight-only) + 2^-7, 2.3%.
E_W8A8_GPU = 2.0 ** -7


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w8a8", "weight-only", "cc70-fp16"])
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("num_tokens", [1, 256])
def test_qwen3_30b_a3b_expert_sizes_on_gpu(monkeypatch, nan_outputs, mode, scheme, num_tokens):
    """Qwen3-30B-A3B's experts (E 128, H 2048, I 768, top-8), per-channel scales or 128 x 128 blocks (the
    checkpoint's layout): bfloat16 W8A8 (where the effective capability is >= 8.9; else it runs weight-only and
    is held to that bound) and weight-only with the default tiles, float16 with the cc-7.0 settings."""
    if mode == "cc70-fp16":
        monkeypatch.setattr(f8, "device_facts", lambda device: ((7, 0), 80))
    dtype = torch.float16 if mode == "cc70-fp16" else torch.bfloat16
    block = (128, 128) if scheme == "block" else None
    e, h, i, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    q13 = torch.randint(0, 256, (e, 2 * i, h), generator=g, device="cuda", dtype=torch.uint8)
    q2 = torch.randint(0, 256, (e, h, i), generator=g, device="cuda", dtype=torch.uint8)
    q13[(q13 & 0x7F) == 0x7F] = 0  # no NaN codes
    q2[(q2 & 0x7F) == 0x7F] = 0
    shape13 = (e, 2 * i // 128, h // 128) if block else (e, 2 * i)
    shape2 = (e, h // 128, i // 128) if block else (e, h)
    # |code values| up to 448: scales around 1 / (448 sqrt(K)) keep the products' sums near 1.
    s13 = torch.rand(shape13, generator=g, device="cuda") * 2e-5 + 1e-5
    s2 = torch.rand(shape2, generator=g, device="cuda") * 4e-5 + 2e-5
    packed = (q13.view(torch.float8_e4m3fn), s13, q2.view(torch.float8_e4m3fn), s2)
    x = torch.randn(num_tokens, h, generator=g, device="cuda").to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, e, generator=g, device="cuda"), k, True)
    out = f8.fused_experts_fp8_triton(x, *packed, weights, ids, block_size=block,
                                      quantize_activations=mode == "w8a8")
    if mode == "w8a8" and f8.uses_w8a8(dtype, f8.device_facts(x.device)[0], True):
        ref, bound = _reference_w8a8(x, packed, (None, None), weights, ids, block), 4 * U[dtype] + E_W8A8_GPU
    else:
        ref, bound = _reference(x, packed, (None, None), weights, ids, block), 4 * U[dtype]
    assert out.dtype == dtype and not out.isnan().any()
    err = ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err < bound, err
