"""Shared pieces of the quantized end-to-end tests: the engine's parity helpers and act-order checkpoints.

The helpers live beside the tests they were written for (tests/models/family_utils.py,
tests/distributed/test_parallel_parity.py); their folders are put on sys.path here, since
`import tests.models...` can resolve to another distribution's top-level `tests` package
(autoawq installs one into site-packages).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from checkpoints import write_quantized_checkpoint

_TESTS = Path(__file__).resolve().parents[1]
for _sub in ("models", "distributed"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.insert(0, str(_TESTS / _sub))

from family_utils import batch_prefill_logits, compare_greedy, hf_greedy, hf_logits  # noqa: E402
from test_parallel_parity import assert_greedy_match  # noqa: E402

__all__ = ["assert_greedy_match", "batch_prefill_logits", "compare_greedy", "hf_greedy", "hf_logits",
           "write_shared_act_order"]


def write_shared_act_order(dense_dir: str, out_dir: str, **variant) -> str:
    """`write_quantized_checkpoint` with one act-order permutation per input width.

    GPTQ orders a layer's columns by its input's Hessian, so layers reading
    the same input (q/k/v, gate/up) share one permutation; tokenmill refuses
    fused parts whose g_idx differ. The fixture writer draws one per module,
    so its draws are made per input width here.
    """
    perms: dict[int, torch.Tensor] = {}
    real_randperm = torch.randperm

    def shared_randperm(n, *args, **kwargs):
        if n not in perms:
            perms[n] = real_randperm(n, *args, **kwargs)
        return perms[n].clone()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "randperm", shared_randperm)
        return write_quantized_checkpoint(dense_dir, out_dir, **variant)
