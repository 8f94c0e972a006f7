"""The large-M int4/int8 tensor-core GEMM (`kernels/triton/quant_gemm_tc.py`) vs dequantize-then-matmul.

CPU: the Triton interpreter (conftest.py), small tiles on tiny shapes: M, N and K not multiples of the tiles,
K not a multiple of the group, groups 16/32/64/128/-1, 4 and 8 bits, with and without zero points, bias,
float32 and float16 x (the interpreter's bfloat16 tl.dot is wrong: test_quant_linear.py's docstring), strided
x, both ways of unpacking the words ("gather", "index") and both places for the unpacked tile ("register",
"shared"). GPU: real Llama-3.1-8B sizes in bfloat16 (tests/gpu marker via `pytest.mark.gpu`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_helpers import dense, random_quant

from tokenmill.kernels.triton import quant_linear as ql
from tokenmill.kernels.triton.quant_gemm_tc import TC_TILES, TcTiles, quant_gemm_tc, tc_supported, tc_tiles

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SMALL = TcTiles(16, 32, 32, 4, 1)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: quick under the interpreter


def _check(y: torch.Tensor, x: torch.Tensor, w, bias=None) -> None:
    ref = x.double() @ dense(w, x.dtype).double().t()
    if bias is not None:
        ref = ref + bias.double()
    assert y.shape == ref.shape and y.dtype == x.dtype and torch.isfinite(y).all()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[x.dtype]
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("bits,group_size,zeros", [(4, 32, True), (4, 64, False), (4, 128, True), (4, -1, False),
                                                   (8, 32, False), (8, -1, True), (4, 16, True)])
@pytest.mark.parametrize("m", [1, 37])
def test_matches_dequantize_then_matmul(bits, group_size, zeros, m):
    k = 200 if group_size in (-1, 16) else 2 * group_size + 40  # K tiles cross group ends; last group partial
    w = random_quant(72, k, bits, group_size, zeros, False, device=DEV)
    x = torch.randn(m, k, device=DEV)
    tiles = SMALL if group_size % 32 == 0 or group_size == -1 else SMALL._replace(block_k=16)
    _check(quant_gemm_tc(x, w, tiles=tiles), x, w)


@pytest.mark.parametrize("bits,group_size,zeros", [(4, 32, True), (8, -1, False)])
def test_unpack_modes_and_operands(bits, group_size, zeros):
    k = 2 * 32 + 40 if group_size == 32 else 200
    w = random_quant(40, k, bits, group_size, zeros, False, device=DEV)
    x = torch.randn(21, k, device=DEV)
    y = quant_gemm_tc(x, w, tiles=TcTiles(16, 32, 32, 4, 1, "index"))
    _check(y, x, w)
    assert torch.equal(y, quant_gemm_tc(x, w, tiles=TcTiles(16, 32, 32, 4, 1, "gather")))
    for unpack in ("index", "gather"):  # the weight tile as the dot's shared-memory operand: y = x W^T
        _check(quant_gemm_tc(x, w, tiles=TcTiles(16, 32, 32, 4, 1, unpack, "shared")), x, w)
    xh = x.to(torch.float16)
    wh = w._replace(scales=w.scales.to(torch.float16))
    _check(quant_gemm_tc(xh, wh, tiles=TcTiles(16, 32, 32, 4, 1, "gather", "shared")), xh, wh)


def test_half_precision_bias_and_strided_x():
    w = random_quant(48, 96, 4, 32, True, False, dtype=torch.float16, device=DEV)
    x = torch.randn(20, 130, device=DEV).to(torch.float16)[:, 3:99]  # row stride 130
    bias = torch.randn(48, device=DEV).to(torch.float16)
    _check(quant_gemm_tc(x, w, bias, tiles=SMALL), x, w, bias)


def test_default_tiles_follow_m_and_the_group():
    for top, t in TC_TILES:
        assert tc_tiles(top, 128) == t._replace(block_k=min(t.block_k, 128))
        assert tc_tiles(top, -1) == t
    assert tc_tiles(TC_TILES[0][0] + 1, -1) == TC_TILES[1][1]
    assert tc_tiles(300, 16).block_k == 16  # BLOCK_K lowered to divide the group
    w = random_quant(40, 256, 4, 128, True, False, device=DEV)
    x = torch.randn(70, 256, device=DEV)
    _check(quant_gemm_tc(x, w), x, w)  # the planned tile for M = 70


def test_supported_and_refused():
    w = random_quant(16, 64, 4, 32, True, False)
    assert tc_supported(w, (9, 0)) and not tc_supported(w, (7, 0))
    wa = random_quant(16, 64, 4, 32, True, True)
    assert not tc_supported(wa, (9, 0))
    with pytest.raises(ValueError, match="act-order"):
        quant_gemm_tc(torch.randn(2, 64), wa)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        quant_gemm_tc(torch.randn(2, 63), w)
    with pytest.raises(ValueError, match="divide the group size 32"):
        quant_gemm_tc(torch.randn(2, 64), w, tiles=(16, 32, 64, 4, 1))
    with pytest.raises(ValueError, match="unpack must be one of"):
        quant_gemm_tc(torch.randn(2, 64), w, tiles=(16, 32, 32, 4, 1, "reshape"))
    with pytest.raises(ValueError, match="operand one of"):
        quant_gemm_tc(torch.randn(2, 64), w, tiles=(16, 32, 32, 4, 1, "index", "global"))


def test_quant_linear_plans_it_between_large_m_min_and_tc_m_max(monkeypatch):
    w = random_quant(32, 128, 4, 64, True, False)
    assert ql.plan_quant_linear(100, 32, w, (9, 0), 132).path == ("tc" if ql.TC_M_MAX >= 100 else "cublas")
    monkeypatch.setattr(ql, "TC_M_MAX", 512)
    assert ql.plan_quant_linear(100, 32, w, (9, 0), 132).path == "tc"
    assert ql.plan_quant_linear(600, 32, w, (9, 0), 132).path == "cublas"
    assert ql.plan_quant_linear(100, 32, w, (7, 0), 132).path == "cublas"  # no tensor cores in tl.dot
    wa = random_quant(32, 128, 4, 64, True, True)
    assert ql.plan_quant_linear(100, 32, wa, (9, 0), 132).path == "cublas"  # act-order: dequantize + cuBLAS
    w = random_quant(32, 128, 4, 64, True, False, dtype=torch.float16, device=DEV)
    x = torch.randn(100, 128, device=DEV).to(torch.float16)
    called = []
    monkeypatch.setattr(ql, "quant_gemm_tc", lambda *a: called.append(1) or quant_gemm_tc(*a))
    _check(ql.quant_linear(x, w), x, w)
    assert called == [1]
    _check(ql.quant_linear(x.float(), w), x.float(), w)  # float32 x: dequantize + cuBLAS instead
    assert called == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [64, 300, 1024])
@pytest.mark.parametrize("unpack,operand", [("index", "register"), ("gather", "register"), ("gather", "shared")])
def test_gpu_real_sizes(n, k, m, unpack, operand):
    w = random_quant(n, k, 4, 128, True, False, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _check(quant_gemm_tc(x, w, tiles=tc_tiles(m, 128)._replace(unpack=unpack, operand=operand)), x, w)


def test_large_m_paths_dry_run(tmp_path, monkeypatch, capsys):
    """benchmarks/gpu/large_m_paths.py's CPU dry run: tile specs parse, every tc tile runs and matches q4_deq,
    the per-M winner table and the JSON are written (the times mean nothing under the interpreter)."""
    if CUDA:
        pytest.skip("the dry run is the CPU (interpreter) mode; on a GPU run the benchmark itself")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
    import large_m_paths

    assert large_m_paths.parse_tile("256x128x64w8s3i") == TcTiles(256, 128, 64, 8, 3, "index")
    assert large_m_paths.parse_tile("128x128x32w8s4gs") == TcTiles(128, 128, 32, 8, 4, "gather", "shared")
    assert all(large_m_paths.tile_spec(large_m_paths.parse_tile(s)) == s for s in large_m_paths.TC_CANDIDATES)
    out = tmp_path / "r.json"
    assert large_m_paths.main(["--dry-run", "--m", "5", "--tc-tiles", "16x32x32w4s1g", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["mismatched"] == []
    assert [(r["m"], r["best_tc"]) for r in result["per_m"]] == [(5, "16x32x32w4s1g")]
    assert "TcTiles(16, 32, 32, 4, 1, 'gather', 'register')" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        large_m_paths.main(["--dry-run", "--tc-tiles", "128x128x64"])  # no warps / stages / unpack
