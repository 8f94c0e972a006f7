"""fp8 KV cache through the engine on a GPU (TRITON_ATTN): CUDA graphs replay the fp8 path, and the cache holds
twice the tokens of a float16 one in the same memory. Kernel accuracy at real sizes: tests/kernels/test_kv_fp8.py."""

from __future__ import annotations

import pytest
import torch
from test_cuda_graphs import TIE_TOL, _workload
from test_cuda_graphs import model_dir as model_dir  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _llm(model_dir: str, **kw):
    from tokenmill import LLM

    return LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, max_model_len=512, max_num_seqs=40,
               attention_backend="TRITON_ATTN", **kw)


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _free(llm) -> None:
    llm.llm_engine.shutdown()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_graphs_match_eager(model_dir, kv):  # noqa: F811
    prompts, params = _workload()
    eager = _llm(model_dir, dtype="float32", num_gpu_blocks_override=512, kv_cache_dtype=kv, enforce_eager=True)
    assert _runner(eager).kv_caches[0].dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.float8_e5m2)
    ref = eager.generate(prompts, params, use_tqdm=False)
    _free(eager)
    graphs = _llm(model_dir, dtype="float32", num_gpu_blocks_override=512, kv_cache_dtype=kv)
    runner = _runner(graphs)
    out = graphs.generate(prompts, params, use_tqdm=False)
    assert runner.cuda_graphs is not None and runner.cuda_graphs.num_replays >= 50
    _free(graphs)
    for r, o in zip(ref, out, strict=True):
        a, b = r.outputs[0].token_ids, o.outputs[0].token_ids
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:  # only a near tie may flip, and the continuations then differ
                top = sorted(r.outputs[0].logprobs[i].values(), key=lambda lp: -lp.logprob)
                assert top[0].logprob - top[1].logprob < TIE_TOL, (i, a, b)
                break


def test_fp8_cache_holds_twice_the_fp16_tokens(model_dir):  # noqa: F811
    tokens = {}
    for kv in ("auto", "fp8"):
        llm = _llm(model_dir, dtype="float16", kv_cache_memory_bytes="256M", kv_cache_dtype=kv)
        cc = llm.llm_engine.engine_core.engine_config.cache_config
        tokens[kv] = cc.num_gpu_blocks * cc.block_size
        _free(llm)
    assert tokens["fp8"] == 2 * tokens["auto"]
