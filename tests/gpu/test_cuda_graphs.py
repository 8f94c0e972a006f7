"""Steps under CUDA graphs (GPU only): same tokens as eager, graphs really replayed, no hidden host sync.

A small random Llama (dummy weights, float32 so graph-vs-eager rounding
cannot reach a token), token-id prompts of mixed lengths and output
lengths, so the decode batch shrinks through sizes that are not capture
sizes (padding rows in use), and prefill steps (alone, or chunked beside
decodes under a small token budget) replay the mixed-step graphs. The
long-context decode graphs (contexts past LONG_DECODE_SEQ = 16384 tokens)
are checked against eager logits on a ModelRunner of max_model_len 16640.
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


# ---- long-context decode graphs (worker/cuda_graph.py: `long_graphs`, replayed past LONG_DECODE_SEQ) ----------

LONG_MAX_LEN = 16384 + 256  # max_model_len just past attention_config.LONG_DECODE_SEQ
LONG_PROMPT = 16384 + 16  # the long request's prompt: its decodes run at contexts past LONG_DECODE_SEQ
LONG_BLOCK = 16


def _long_runner(enforce_eager: bool):
    """A ModelRunner on CUDA over a tiny random float32 Llama (2 layers, hidden 128, 4 heads / 2 KV heads of
    32), max_model_len LONG_MAX_LEN, 4 sequences, TRITON_ATTN; the same weights for both values of
    `enforce_eager`. Weights std 0.2: attention scores spread ~5 wide, so a decode's attention rests on few
    positions of its 16k context and a wrong or missed KV block shows in the logits."""
    from transformers import LlamaConfig

    from tokenmill.config import (
        CacheConfig,
        DeviceConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tokenmill.model_loader.dummy import initialize_dummy_weights
    from tokenmill.models.llama import LlamaForCausalLM
    from tokenmill.worker.model_runner import ModelRunner

    hf = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LONG_MAX_LEN,
                     rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                     architectures=["LlamaForCausalLM"])
    mc = ModelConfig(model="tiny-long", model_path="tiny-long", gguf_file=None, tokenizer=None,
                     skip_tokenizer_init=True, load_format="dummy", dtype="float32", seed=0,
                     max_model_len=LONG_MAX_LEN, architecture="LlamaForCausalLM", hf_config=hf)
    cfg = EngineConfig(mc, CacheConfig(block_size=LONG_BLOCK, num_gpu_blocks_override=1100),
                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=LONG_MAX_LEN, max_model_len=LONG_MAX_LEN),
                       ParallelConfig(),
                       DeviceConfig(device="cuda", attention_backend="TRITON_ATTN", enforce_eager=enforce_eager))
    runner = ModelRunner(cfg, torch.device("cuda"))
    model = LlamaForCausalLM(hf)
    initialize_dummy_weights(model, seed=0, std=0.2)  # on the CPU: the same weights in both runners
    runner.model = model.to("cuda").eval()
    runner.initialize_kv_cache(runner.determine_num_available_blocks())
    return runner


def _long_run(runner) -> tuple[list[list[int]], list[torch.Tensor], list[int]]:
    """One prefill step (a LONG_PROMPT-token prompt and two short ones), 3 decode steps of the three (a padded
    batch: graph size 4), then the short ones finish and 2 decode steps of the long one alone (size 1).

    Returns each step's sampled ids, its logits ([requests, vocab] float32, as the sampler got them) and the
    longest sequence of each step.
    """
    from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
    from tokenmill.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = {rid: torch.randint(0, 512, (n,), generator=g).tolist()
               for rid, n in (("long", LONG_PROMPT), ("s1", 40), ("s2", 70))}
    blocks, start = {}, 1
    for rid, p in prompts.items():  # room for 8 more tokens each
        n = -(-(len(p) + 8) // LONG_BLOCK)
        blocks[rid], start = list(range(start, start + n)), start + n
    logits: list[torch.Tensor] = []
    compute = runner.model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        logits.append(out.detach().clone())
        return out

    runner.model.compute_logits = spy
    greedy = SamplingParams(temperature=0.0)
    new = [NewRequestData(rid, p, [], greedy, blocks[rid], 0) for rid, p in prompts.items()]
    computed = {rid: len(p) for rid, p in prompts.items()}
    outs = [runner.execute_model(SchedulerOutput(new, CachedRequestData(), dict(computed), sum(computed.values()),
                                                 set()))]
    longest = [LONG_PROMPT]
    for k in range(5):
        finished = {"s1", "s2"} if k == 3 else set()
        for rid in finished:
            computed.pop(rid)
        cached = CachedRequestData()
        for rid, nc in computed.items():
            cached.req_ids.append(rid)
            cached.new_block_ids.append([])
            cached.num_computed_tokens.append(nc)
        outs.append(runner.execute_model(SchedulerOutput([], cached, {rid: 1 for rid in computed}, len(computed),
                                                         finished)))
        longest.append(computed["long"] + 1)
        computed = {rid: nc + 1 for rid, nc in computed.items()}
    torch.cuda.synchronize()
    return [o.sampled_token_ids for o in outs], logits, longest


def test_long_context_decode_graph_matches_eager(monkeypatch):
    """Decode steps at contexts past LONG_DECODE_SEQ replay the long graphs (more KV splits, fixed at capture
    for max_model_len) and give the eager run's logits. Eager picks its split count from the step's own
    longest sequence; at the graph's own size that is the same count (checked here, and on CPU in
    tests/worker/test_cuda_graph.py), so both run the same attention; the padded steps (3 requests in the
    graph of 4) may split differently and differ by float rounding only."""
    from tokenmill.kernels.triton.attention_config import LONG_DECODE_SEQ, choose_num_splits
    from tokenmill.worker.cuda_graph import padded_size

    monkeypatch.setenv("TOKENMILL_MIXED_CUDA_GRAPHS", "0")  # the prompts' step is eager either way (> 2048 tokens)
    eager = _long_runner(enforce_eager=True)
    assert eager.cuda_graphs is None
    ref_ids, ref_logits, longest = _long_run(eager)
    eager.release()
    del eager
    torch.cuda.empty_cache()

    runner = _long_runner(enforce_eager=False)
    graphs = runner.cuda_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert {1, 4} <= set(graphs.long_graphs)  # H200, 2 kv heads: 64 splits past LONG_DECODE_SEQ, 16 below
    ids, logits, _ = _long_run(runner)
    # Five decode steps, each past LONG_DECODE_SEQ, each a long graph's replay (3 of size 4, 2 of size 1).
    assert all(n > LONG_DECODE_SEQ for n in longest[1:])
    assert (graphs.num_replays, graphs.num_long_replays, graphs.num_mixed_replays) == (5, 5, 0)
    assert ids == ref_ids
    dev, kv_heads = torch.device("cuda"), runner.kv_caches[0].shape[-2]
    assert len(logits) == len(ref_logits) == 6
    for step, (got, want) in enumerate(zip(logits, ref_logits)):
        n = got.shape[0]
        diff = (got - want).abs().max().item()
        if step == 0:  # the prompts' step: eager in both runners, the same kernels
            assert torch.equal(got, want), f"prefill logits differ by up to {diff}"
            continue
        size = padded_size(graphs.sizes, n)
        if size == n:  # the graph's own size: the split count eager picks is the graph's
            assert (choose_num_splits(dev, 1, n, kv_heads, longest[step])
                    == choose_num_splits(dev, 1, size, kv_heads, LONG_MAX_LEN))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, step=step, diff=diff: f"decode step {step}: max |diff| {diff}; {m}")
    runner.release()
