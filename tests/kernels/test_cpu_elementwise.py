"""CPU C kernels for RMSNorm (+ residual add) and SiLU-and-mul vs their PyTorch reference (forward_torch).

The kernels round where the reference rounds, so bfloat16 results agree to
the bit except where a float32 sum is added in another order (a few elements
in thousands move by one bfloat16 ulp); float32 agrees to ~1e-6. Without a C
compiler these tests skip and the layers run their PyTorch path.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu import build as cpu_build, elementwise as cpu_elementwise
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm


@pytest.fixture(scope="module")
def lib(require_cpu_kernel):
    return require_cpu_kernel(cpu_elementwise.load, cpu_elementwise._SOURCE)


def _norm(n: int, dtype: torch.dtype, gemma: bool, seed: int) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(n, eps=1e-5, gemma=gemma)
    norm.weight.data = (torch.randn(n, generator=g) * 0.5 + (0.0 if gemma else 1.0)).to(dtype)
    return norm


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        # A float32 sum added in another order can move an element by one bfloat16 ulp (two after the
        # weight's multiply), and does so in only a small share of the elements.
        torch.testing.assert_close(got, want, atol=0, rtol=2**-6)
        assert (got != want).float().mean().item() < 0.01
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (7, 100), (64, 576), (3, 5, 48), (300, 2048)])
def test_rms_norm_matches_reference(lib, dtype, gemma, shape):
    """Plain and with the residual add; widths that are and are not multiples of 16; 3-D input."""
    norm = _norm(shape[-1], dtype, gemma, seed=len(shape) + shape[-1])
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    _close(norm(x), norm.forward_torch(x))
    out, summed = norm(x, residual)
    want_out, want_summed = norm.forward_torch(x, residual)
    assert torch.equal(summed, want_summed)  # x + residual: one rounding, the same bits
    _close(out, want_out)


def test_rms_norm_reads_strided_rows(lib):
    """A 2-D view with a row stride (e.g. a slice of a wider tensor) is read in place."""
    norm = _norm(64, torch.bfloat16, False, seed=2)
    wide = torch.randn(16, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    x, residual = wide[:, :64], wide[:, 32:]
    assert not x.is_contiguous()
    _close(norm(x), norm.forward_torch(x))
    out, summed = norm(x, residual)
    want_out, want_summed = norm.forward_torch(x, residual)
    assert torch.equal(summed, want_summed)
    _close(out, want_out)


def test_rms_norm_does_not_modify_inputs(lib):
    norm = _norm(32, torch.float32, False, seed=4)
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    x0, r0 = x.clone(), residual.clone()
    norm(x, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


def test_rms_norm_rejects_a_weight_of_another_dtype(lib):
    with pytest.raises(ValueError, match="weight must be"):
        cpu_elementwise.rms_norm(lib, torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6, False)
    # The layer itself falls back to PyTorch in that case, with the reference's result.
    norm = RMSNorm(8)
    norm.weight.data = norm.weight.data.bfloat16()
    x = torch.randn(2, 8)
    assert torch.equal(norm(x), norm.forward_torch(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 40), (64, 2 * 1536), (2, 3, 2 * 24)])
def test_silu_and_mul_matches_reference(lib, dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    x.view(-1)[:6] = torch.tensor([-200.0, -90.0, -20.0, 20.0, 90.0, 200.0], dtype=dtype)  # exp's far ends
    act = SiluAndMul()
    got, want = act(x), act.forward_torch(x)
    assert torch.isfinite(got).all()
    _close(got, want)


def test_layers_route_cpu_tensors_to_the_kernels(lib, monkeypatch):
    calls = []
    real_norm, real_act = cpu_elementwise.rms_norm, cpu_elementwise.silu_and_mul
    monkeypatch.setattr(cpu_elementwise, "rms_norm", lambda *a, **k: calls.append("norm") or real_norm(*a, **k))
    monkeypatch.setattr(cpu_elementwise, "silu_and_mul", lambda *a: calls.append("act") or real_act(*a))
    x = torch.randn(3, 16)
    RMSNorm(16)(x)
    RMSNorm(16)(x, x)
    SiluAndMul()(torch.randn(3, 32))
    SiluAndMul()(torch.randn(3, 32, dtype=torch.float64))  # not a kernel dtype: PyTorch
    real_rope = cpu_elementwise.rotary_neox
    monkeypatch.setattr(cpu_elementwise, "rotary_neox", lambda *a: calls.append("rope") or real_rope(*a))
    from tokenmill.layers.rotary import get_rope

    rope = get_rope(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    rope(torch.tensor([1, 2, 3]), torch.randn(3, 32), torch.randn(3, 16))
    rope(torch.tensor([1, 2, 3]), torch.randn(6, 16), torch.randn(6, 16))  # rows != positions: forward_cpu
    assert calls == ["norm", "norm", "act", "rope"]


def test_env_switch_keeps_the_pytorch_path(monkeypatch):
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    assert cpu_elementwise.load() is None
    norm = _norm(48, torch.bfloat16, False, seed=6)
    x = torch.randn(4, 48).bfloat16()
    assert torch.equal(norm(x), norm.forward_torch(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 40])
def test_rope_is_bit_identical_to_the_reference(lib, dtype, head_size):
    """q and k as row-strided views of one fused qkv output (the models' case) and as contiguous 3-D tensors."""
    from tokenmill.layers.rotary import get_rope

    rope = get_rope(head_size, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    g = torch.Generator().manual_seed(7)
    num_tokens, nq, nk = 9, 6, 2
    qkv = (torch.randn(num_tokens, (nq + 2 * nk) * head_size, generator=g) * 3).to(dtype)
    q, k, _ = qkv.split([nq * head_size, nk * head_size, nk * head_size], dim=-1)
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 4095, 3, 3])
    got_q, got_k = rope(positions, q, k)
    want_q, want_k = rope.forward_torch(positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    q3, k3 = q.reshape(num_tokens, nq, head_size).contiguous(), k.reshape(num_tokens, nk, head_size).contiguous()
    assert cpu_elementwise.rope_supports(positions, q3, k3, rope.cos_cache, rope.sin_cache)
    got_q, got_k = rope(positions, q3, k3)
    assert got_q.shape == q3.shape and torch.equal(got_q, want_q.view(q3.shape))
    assert torch.equal(got_k, want_k.view(k3.shape))


def test_rope_rejects_a_position_past_the_table(lib):
    from tokenmill.layers.rotary import get_rope

    rope = get_rope(16, 32, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(2, 32), torch.randn(2, 16)
    with pytest.raises(IndexError, match="outside"):
        rope(torch.tensor([3, 32]), q, k)


def _kv_write_case(dtype: torch.dtype, seed: int):
    """Key / value as row-strided views of one fused qkv output (the models' case), a cache with garbage in it,
    slots that cross blocks and include padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    num_tokens, hkv, d, num_blocks, block_size = 6, 3, 64, 5, 16
    qkv = (torch.randn(num_tokens, (9 + 2 * hkv) * d, generator=g) * 3).to(dtype)
    _, k, v = qkv.split([9 * d, hkv * d, hkv * d], dim=-1)
    key, value = k.view(num_tokens, hkv, d), v.view(num_tokens, hkv, d)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    slots = torch.tensor([0, 17, -1, 79, 15, 40])
    return key, value, cache, slots


def _kv_write_reference(key, value, cache, slots):
    """`torch_sdpa.write_kv_cache`'s PyTorch path: index_copy_ of the valid rows."""
    want = cache.clone()
    flat = want.view(2, -1, *cache.shape[3:])
    valid = slots >= 0
    flat[0].index_copy_(0, slots[valid], key[valid])
    flat[1].index_copy_(0, slots[valid], value[valid])
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_is_the_index_copy_reference(lib, dtype):
    from tokenmill.attention.backends.torch_sdpa import write_kv_cache

    key, value, cache, slots = _kv_write_case(dtype, seed=9)
    want = _kv_write_reference(key, value, cache, slots)
    assert cpu_elementwise.kv_write_supports(key, value, cache, slots)
    got = cache.clone()
    cpu_elementwise.write_kv_cache(lib, key, value, got, slots)
    assert torch.equal(got, want)
    got = cache.clone()  # the backend's entry point takes the kernel
    write_kv_cache(key, value, got, slots, use_cpu_kernel=True)
    assert torch.equal(got, want)


def test_write_kv_cache_rejects_bad_slots_and_layouts(lib):
    key, value, cache, slots = _kv_write_case(torch.bfloat16, seed=10)
    before = cache.clone()
    with pytest.raises(IndexError, match="outside"):
        cpu_elementwise.write_kv_cache(lib, key, value, cache, torch.tensor([0, 1, 2, 3, 4, 80]))
    assert torch.equal(cache, before)  # checked before any row is written
    with pytest.raises(ValueError, match="cache.s dtype"):  # a dtype other than the cache's
        cpu_elementwise.write_kv_cache(lib, key.float(), value.float(), cache, slots)
    # An fp8 cache, heads that are not one run, or a cache without its two (K, V) halves keep the PyTorch path.
    assert not cpu_elementwise.kv_write_supports(key.transpose(1, 2).contiguous().transpose(1, 2), value, cache, slots)
    assert not cpu_elementwise.kv_write_supports(key, value, cache.to(torch.float8_e4m3fn), slots)
    assert not cpu_elementwise.kv_write_supports(key, value, cache[:1].contiguous(), slots)


def test_wrappers_reject_layouts_they_do_not_take(lib):
    with pytest.raises(ValueError, match="even last dim"):
        cpu_elementwise.silu_and_mul(lib, torch.randn(2, 7))
    with pytest.raises(ValueError, match="layout"):
        cpu_elementwise.rms_norm(lib, torch.randn(4, 3, 8).transpose(0, 1), torch.ones(8), 1e-6, False)
    rope_cos, rope_sin = torch.randn(10, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match="layouts"):  # 3 rows for 4 positions
        cpu_elementwise.rotary_neox(lib, torch.arange(4), torch.randn(3, 16), torch.randn(3, 8), rope_cos, rope_sin)


def test_plain_c_path_without_avx512(plain_c_kernels):
    """The same source built for a CPU without AVX-512 (x86-64-v3) runs its plain-C loops, also right."""
    plain = cpu_elementwise.load()
    assert plain is not None
    norm = _norm(100, torch.bfloat16, False, seed=8)
    x, residual = torch.randn(5, 100).bfloat16(), torch.randn(5, 100).bfloat16()
    out, summed = cpu_elementwise.rms_norm(plain, x, norm.weight, norm.eps, False, residual)
    want_out, want_summed = norm.forward_torch(x, residual)
    assert torch.equal(summed, want_summed)
    _close(out, want_out)
    gate_up = (torch.randn(4, 2 * 40) * 4).bfloat16()
    assert torch.equal(cpu_elementwise.silu_and_mul(plain, gate_up), SiluAndMul().forward_torch(gate_up))
    from tokenmill.layers.rotary import get_rope

    rope = get_rope(40, 128, {"rope_type": "default", "rope_theta": 10000.0})
    pos, q, k = torch.tensor([0, 5, 127]), torch.randn(3, 80).bfloat16(), torch.randn(3, 40).bfloat16()
    got = cpu_elementwise.rotary_neox(plain, pos, q, k, rope.cos_cache, rope.sin_cache)
    want = rope.forward_torch(pos, q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    key, value, cache, slots = _kv_write_case(torch.bfloat16, seed=11)
    got = cache.clone()
    cpu_elementwise.write_kv_cache(plain, key, value, got, slots)
    assert torch.equal(got, _kv_write_reference(key, value, cache, slots))
