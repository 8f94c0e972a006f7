"""CPU GGUF kernels (`kernels/cpu/gguf_matmul.c`) vs the `gguf` package's dequantization + a float matmul.

Random bytes are valid blocks of every type once their float16 scales are
made finite and small, so each test draws whole random rows. Dequantization
must be the reference's bits; products differ from `x @ W^T` of those
weights only in the float32 summation order (and, with AVX-512, in factoring
each 32-weight chunk's scale and offset out of its products).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.kernels.cpu import gguf_matmul
from tokenmill.kernels.cpu.gguf_matmul import KERNEL_BLOCKS, row_bytes
from tokenmill.layers.gguf_weights import KERNEL_MAX_TOKENS, GGUFSegment, GGUFWeight

TYPES = sorted(KERNEL_BLOCKS)
# byte offsets of each block's float16 scales (ggml-common.h)
_HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                 "Q6_K": (208,)}


@pytest.fixture(scope="module")
def lib(require_cpu_kernel):
    return require_cpu_kernel(gguf_matmul.load, gguf_matmul._SOURCE)


def random_rows(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """[rows, row_bytes] uint8 of random blocks whose float16 scales are N(0, 0.05)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, row_bytes(qtype, k)), dtype=np.uint8)
    blocks = raw.reshape(-1, KERNEL_BLOCKS[qtype][2])
    for off in _HALF_OFFSETS[qtype]:
        halves = rng.normal(0, 0.05, blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw)


def reference(blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    deq = dequantize(blocks.numpy().reshape(-1), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.array(deq, dtype=np.float32)).reshape(blocks.shape[0], k)


def _check_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().T
    # float32 sums of k products: error <= k * eps * sum |x_i w_i| (loose), far below a wrong weight's effect
    bound = x.double().abs() @ w.double().abs().T * (x.shape[1] * 2**-24) + 1e-30
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_the_reference_bitwise(lib, qtype):
    k = 512
    blocks = random_rows(qtype, 7, k, seed=1)
    assert torch.equal(gguf_matmul.dequantize(lib, blocks, qtype, k), reference(blocks, qtype, k))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 6])
def test_matmul_float32(lib, qtype, num_tokens):
    k, n = 512, 37
    blocks = random_rows(qtype, n, k, seed=2)
    x = torch.randn(num_tokens, k, generator=torch.Generator().manual_seed(3))
    _check_product(gguf_matmul.matmul(lib, blocks, qtype, k, x), x, reference(blocks, qtype, k))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("k", [32, 576, 1056])
def test_one_token_gathered_scales_path(lib, qtype, k):
    # One-token rows of Q4_1, Q5_0 and Q5_1 take row_dot1_small (scales gathered 16 chunks at a time):
    # 1, 18 and 33 chunks (a partial gather, an odd last chunk). 5 tokens: a 4-token pass, then a 1-token one.
    # The general path (gguf_gather_scales = 0) must stay right too; both within the float32 bound.
    import ctypes

    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        pytest.skip("row_dot1_small is AVX-512 code; without it both settings run the plain C loop")
    blocks = random_rows(qtype, 23, k, seed=k)
    w = reference(blocks, qtype, k)
    flag = ctypes.c_int.in_dll(lib, "gguf_gather_scales")
    assert flag.value == 1
    for num_tokens in (1, 5):
        x = torch.randn(num_tokens, k, generator=torch.Generator().manual_seed(num_tokens))
        got = gguf_matmul.matmul(lib, blocks, qtype, k, x)
        _check_product(got, x, w)
        try:
            flag.value = 0
            general = gguf_matmul.matmul(lib, blocks, qtype, k, x)
        finally:
            flag.value = 1
        _check_product(general, x, w)
        if num_tokens == 5:  # its 4-token pass is the same code either way
            assert torch.equal(got[:4], general[:4])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_matmul_bfloat16_strided_x_and_out_slice(lib, qtype):
    k, n = 256, 20
    blocks = random_rows(qtype, n, k, seed=4)
    wide = torch.randn(3, k + 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    x = wide[:, 32:32 + k]  # row stride k + 64
    out = torch.full((3, n + 10), 7.0, dtype=torch.bfloat16)
    gguf_matmul.matmul(lib, blocks, qtype, k, x, out=out.narrow(1, 5, n))
    want = (x.double() @ reference(blocks, qtype, k).double().T)
    torch.testing.assert_close(out[:, 5:5 + n].double(), want, rtol=2**-7, atol=1e-2 * want.abs().max().item())
    assert (out[:, :5] == 7).all() and (out[:, 5 + n:] == 7).all()  # nothing outside its columns


def test_refuses_wrong_shapes(lib):
    blocks = random_rows("Q4_0", 4, 64, seed=6)
    with pytest.raises(ValueError, match="bytes"):
        gguf_matmul.matmul(lib, blocks, "Q4_0", 96, torch.zeros(1, 96))
    with pytest.raises(ValueError, match="not one the CPU kernels"):
        gguf_matmul.matmul(lib, blocks, "Q5_K", 64, torch.zeros(1, 64))
    with pytest.raises(ValueError, match="x must be"):
        gguf_matmul.matmul(lib, blocks, "Q4_0", 64, torch.zeros(1, 64, dtype=torch.float64))


def test_weight_of_mixed_segments_kernel_and_blas_paths(lib):
    """q|k in Q4_K and v in Q6_K (as Q4_K_M files store them), with a bias; small and large batches."""
    k = 256
    parts = [("Q4_K", random_rows("Q4_K", 24, k, seed=7)), ("Q6_K", random_rows("Q6_K", 8, k, seed=8))]
    weight = GGUFWeight([GGUFSegment(0, *parts[0]), GGUFSegment(24, *parts[1])], 32, k)
    w = torch.cat([reference(b, t, k) for t, b in parts])
    assert torch.equal(weight.dequantize(), w)
    bias = torch.randn(32)
    for num_tokens in (1, KERNEL_MAX_TOKENS, KERNEL_MAX_TOKENS + 1, 40):
        x = torch.randn(2, num_tokens, k, generator=torch.Generator().manual_seed(num_tokens))
        got = weight.matmul(x, bias)
        assert got.shape == (2, num_tokens, 32)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_weight_refuses_gaps(lib):
    with pytest.raises(ValueError, match="tile"):
        GGUFWeight([GGUFSegment(4, "Q8_0", random_rows("Q8_0", 4, 32, seed=9))], 8, 32)


def test_plain_c_path_without_avx512(plain_c_kernels):
    """The source built for a CPU without AVX-512 (x86-64-v3) runs its plain-C loops, also right."""
    plain = gguf_matmul.load()
    assert plain is not None
    k = 256
    for i, qtype in enumerate(TYPES):
        blocks = random_rows(qtype, 9, k, seed=20 + i)
        w = reference(blocks, qtype, k)
        assert torch.equal(gguf_matmul.dequantize(plain, blocks, qtype, k), w)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(i))
        _check_product(gguf_matmul.matmul(plain, blocks, qtype, k, x), x, w)
