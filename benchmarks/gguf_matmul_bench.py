"""One-token GGUF matmul on this CPU: the gathered-scales path against the general one, in one process.

    PYTHONPATH=. python benchmarks/gguf_matmul_bench.py [--threads 1] [--repeats 9]

For each case (type, k, rows: about SmolLM2-135M's 30 layers of Q4_1 (66 MB), and other types), random valid
blocks and one float32 token are multiplied through `kernels/cpu/gguf_matmul.c` with `gguf_gather_scales` = 0
(row_dot: each chunk's float16 scale and offset converted on their own) and = 1 (row_dot1_small: 16 chunks'
scales in one gather), alternated twice; prints the minimum ms per call of each, GB/s of blocks read and the
largest error of each against float64 products of the dequantized weights (relative to the largest output).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.kernels.cpu import gguf_matmul as gm  # noqa: E402

# (type, k, rows)
CASES = (("Q4_1", 576, 183_000), ("Q4_1", 1536, 68_000), ("Q5_1", 576, 100_000),
         ("Q5_0", 576, 100_000))


def random_blocks(qtype: str, rows: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """[rows, row_bytes] uint8: random quants, float16 scale d in [0.001, 0.011) (and offset m in (-0.01, 0])."""
    _, _, nbytes = gm.KERNEL_BLOCKS[qtype]
    chunks = k // 32
    b = rng.integers(0, 256, size=(rows, chunks, nbytes), dtype=np.uint8)
    d = (rng.random((rows, chunks)) * 0.01 + 0.001).astype(np.float16)
    b[:, :, 0:2] = d.view(np.uint8).reshape(rows, chunks, 2)
    if qtype in ("Q4_1", "Q5_1"):
        b[:, :, 2:4] = (-rng.random((rows, chunks)) * 0.01).astype(np.float16).view(np.uint8).reshape(rows, chunks, 2)
    return torch.from_numpy(b.reshape(rows, -1).copy())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    lib = gm.load()
    if lib is None:
        print("gguf_matmul_bench: the C kernels did not build here")
        return 2
    flag = ctypes.c_int.in_dll(lib, "gguf_gather_scales")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    for qtype, k, rows in CASES:
        w = random_blocks(qtype, rows, k, rng)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
        best: dict[int, float] = {}
        outs: dict[int, torch.Tensor] = {}
        for setting in (0, 1, 0, 1):
            flag.value = setting
            for _ in range(2):
                gm.matmul(lib, w, qtype, k, x)
            for _ in range(args.repeats):
                t = time.perf_counter()
                outs[setting] = gm.matmul(lib, w, qtype, k, x)
                best[setting] = min(best.get(setting, float("inf")), time.perf_counter() - t)
        flag.value = 1
        ref = gm.dequantize(lib, w[:256], qtype, k).double() @ x[0].double()
        errs = [((outs[s][0, :256].double() - ref).abs().max() / ref.abs().max()).item() for s in (0, 1)]
        mb = w.numel() / 1e6
        print(f"{qtype} k={k} {mb:.1f} MB, {args.threads} thread(s): general {best[0] * 1e3:.2f} ms "
              f"({mb / 1e3 / best[0]:.1f} GB/s), gathered scales {best[1] * 1e3:.2f} ms "
              f"({mb / 1e3 / best[1]:.1f} GB/s), "
              f"{best[0] / best[1]:.2f}x; max rel err {errs[0]:.1e} / {errs[1]:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
