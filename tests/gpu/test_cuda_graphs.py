"""Steps under CUDA graphs (GPU only): same tokens as eager, graphs really replayed, no hidden host sync.

A small random Llama (dummy weights, float32 so graph-vs-eager rounding
cannot reach a token), token-id prompts of mixed lengths and output
lengths, so the decode batch shrinks through sizes that are not capture
sizes (padding rows in use), and prefill steps (alone, or chunked beside
decodes under a small token budget) replay the mixed-step graphs.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

TIE_TOL = 1e-4  # float32 logprob gap under which two engines may pick different tokens


def _model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("graph_llama")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _model_dir(tmp_path_factory)


def _llm(model_dir: str, **kw):
    from tokenmill import LLM

    return LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
               max_model_len=512, max_num_seqs=40, num_gpu_blocks_override=512, attention_backend="TRITON_ATTN",
               **kw)


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _workload(n: int = 21):
    g = torch.Generator().manual_seed(0)
    prompts, params = [], []
    from tokenmill import SamplingParams

    for i in range(n):
        length = int(torch.randint(3, 70, (1,), generator=g))
        prompts.append({"prompt_token_ids": torch.randint(5, 1000, (length,), generator=g).tolist()})
        params.append(SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=2))
    return prompts, params


@pytest.mark.parametrize("budget", [None, 48])
def test_graphs_replayed_and_match_eager(model_dir, budget):
    """budget 48: prompts of up to 69 tokens are chunked, their chunks scheduled beside running decodes."""
    from tokenmill.worker.cuda_graph import mixed_capture_sizes

    prompts, params = _workload()
    kw = {} if budget is None else {"max_num_batched_tokens": budget, "enable_chunked_prefill": True}
    eager = _llm(model_dir, enforce_eager=True, **kw)
    assert _runner(eager).cuda_graphs is None
    ref = eager.generate(prompts, params, use_tqdm=False)
    eager.llm_engine.shutdown()
    del eager
    torch.cuda.empty_cache()

    graphs = _llm(model_dir, **kw)
    runner = _runner(graphs)
    assert runner.cuda_graphs is not None and runner.cuda_graphs.sizes == [1, 2, 4, 8, 16, 32, 40]
    assert runner.cuda_graphs.mixed_sizes == (mixed_capture_sizes(runner.max_num_tokens) if budget is None
                                              else [16, 32, 48])
    out = graphs.generate(prompts, params, use_tqdm=False)
    # 21 requests of 4..64 tokens: decode batches of 21 down to 1, most of them padded.
    assert runner.cuda_graphs.num_replays >= 50
    # Every step with prefill tokens replays a mixed graph (all fit the largest): with budget 48, at least
    # ceil(prompt tokens / 48) of them (H200, session 10: 17).
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    assert runner.cuda_graphs.num_mixed_replays >= (1 if budget is None else -(-prompt_tokens // budget))
    compared = 0
    for r, o in zip(ref, out):
        a, b = r.outputs[0].token_ids, o.outputs[0].token_ids
        assert len(a) == len(b)
        for pos, (x, y) in enumerate(zip(a, b)):
            if x != y:
                top = sorted(r.outputs[0].logprobs[pos].values(), key=lambda lp: -lp.logprob)
                gap = top[0].logprob - top[1].logprob
                assert gap < TIE_TOL, f"token {pos}: graph {y} vs eager {x}, top-2 gap {gap}"
                break
            compared += 1
    assert compared > 0.9 * sum(len(r.outputs[0].token_ids) for r in ref)
    graphs.llm_engine.shutdown()


def test_decode_steps_make_no_hidden_sync(model_dir):
    """Every decode step (graph replay, sampling, the results' copy) under sync debug mode "error"."""
    from tokenmill import SamplingParams

    llm = _llm(model_dir)
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=24, ignore_eos=True, logprobs=3)]
    for i in range(5):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(10 + i, 40 + 7 * i))}, params[i % 3])
    runner = _runner(llm)
    engine.step()  # the five prompts (< the token budget) prefill in one step, outside the check
    engine.step()  # the first decode, outside the check too
    replays = runner.cuda_graphs.num_replays
    steps = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps == 10
    assert runner.cuda_graphs.num_replays - replays == 10
    engine.shutdown()


def test_mixed_step_makes_no_hidden_sync(model_dir):
    """A prompt arriving beside running decodes: its step replays a mixed graph under sync debug mode "error"."""
    from tokenmill import SamplingParams

    llm = _llm(model_dir)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(10 + i, 30 + 5 * i))}, greedy)
    runner = _runner(llm)
    engine.step()  # the three prompts, outside the check
    engine.step()  # their first decode
    engine.add_request("late", {"prompt_token_ids": list(range(50, 90))},
                       SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True))
    mixed = runner.cuda_graphs.num_mixed_replays
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.step()  # the late prompt's 40 tokens beside three decodes
        engine.step()  # four decodes
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert runner.cuda_graphs.num_mixed_replays == mixed + 1
    engine.shutdown()
