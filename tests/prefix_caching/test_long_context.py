"""Long context: chunked prefill up to max_model_len, and TORCH_SDPA memory bounded by the chunk.

1. A prompt of max_model_len - 8 tokens on a tiny random Llama runs in
   chunks of the token budget and gives the same tokens (and logprobs to
   float tolerance) as one unchunked prefill.
2. The peak memory one TORCH_SDPA call allocates on CPU, for one prefill
   chunk over a cached context, does not grow with the context: it is
   O(heads x chunk x tile), not O(heads x chunk x context).

Peak memory on CPU: `tracemalloc` does not see torch's allocator, so the
test reads torch's own allocation records: `torch.profiler` with
`profile_memory=True` logs every CPU allocation (+bytes) and free (-bytes)
as a "[memory]" event; the running sum in time order is the memory held,
and its maximum the peak (relative to the start of the profiled call).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.metadata import AttentionMetadata

MAX_MODEL_LEN = 2048
BUDGET = 256


def peak_cpu_bytes(fn) -> int:
    """Largest number of bytes torch held at once (above the start) while `fn()` ran, on CPU."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()  # + on allocation, - on free
        peak = max(peak, held)
    return peak


def test_peak_cpu_bytes_sees_torch_allocations():
    def work():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = a * 2  # 4 MiB more while a lives
        del a, b
        torch.ones(256, 1024)  # 1 MiB, after both are gone

    assert 8 * 2**20 <= peak_cpu_bytes(work) < 9 * 2**20


# ---------------------------------------------------------------- 1. chunked prefill at max_model_len


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny_llama_2k")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


def _run_long_prompt(folder: str, **engine_kwargs):
    llm = LLM(folder, load_format="dummy", skip_tokenizer_init=True, dtype="float32", seed=0,
              max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes="8M", **engine_kwargs)
    prompt = np.random.default_rng(0).integers(0, 512, MAX_MODEL_LEN - 8).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, detokenize=False)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    stats = llm.llm_engine.get_stats()
    llm.llm_engine.shutdown()
    return out.outputs[0], stats


def test_prompt_near_max_model_len_chunked_matches_unchunked(tiny_llama_dir):
    chunked, stats_c = _run_long_prompt(tiny_llama_dir, max_num_batched_tokens=BUDGET)
    whole, stats_w = _run_long_prompt(tiny_llama_dir, max_num_batched_tokens=MAX_MODEL_LEN,
                                      enable_chunked_prefill=False)
    # 2040 prompt tokens in chunks of 256: 7 steps whose chunk ends short of the prompt.
    assert stats_c.num_chunked_prefill_steps == (MAX_MODEL_LEN - 8 - 1) // BUDGET
    assert stats_w.num_chunked_prefill_steps == 0
    assert len(chunked.token_ids) == 8
    for pos, (a, b) in enumerate(zip(chunked.token_ids, whole.token_ids)):
        lp_a, lp_b = chunked.logprobs[pos], whole.logprobs[pos]
        if a != b:  # allowed only at a near tie of the two runs' best tokens
            assert abs(lp_a[a].logprob - lp_b[b].logprob) < 1e-4, f"token {pos}: {a} != {b}"
            break
        assert lp_a[a].logprob == pytest.approx(lp_b[b].logprob, abs=1e-4)


# ---------------------------------------------------------------- 2. TORCH_SDPA peak memory


H, HKV, D, BLOCK = 9, 3, 64, 16  # SmolLM2's attention shape
CHUNK = 256
SDPA_MAX_LEN = 8192


def _chunk_over_context(context_len: int):
    """(backend call, reference output): one request, `CHUNK` new tokens after `context_len` cached ones."""
    seq_len = context_len + CHUNK
    num_blocks = -(-seq_len // BLOCK)
    g = torch.Generator().manual_seed(context_len)
    kv_cache = torch.randn(2, num_blocks, BLOCK, HKV, D, generator=g)
    query = torch.randn(CHUNK, H, D, generator=g)
    key = torch.randn(CHUNK, HKV, D, generator=g)
    value = torch.randn(CHUNK, HKV, D, generator=g)
    qsl = np.array([0, CHUNK], dtype=np.int32)
    seq_lens = np.array([seq_len], dtype=np.int32)
    md = AttentionMetadata(
        num_actual_tokens=CHUNK, num_reqs=1, max_query_len=CHUNK, max_seq_len=seq_len,
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.arange(num_blocks, dtype=torch.int32)[None],  # blocks 0.. in order
        slot_mapping=torch.arange(context_len, seq_len, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    backend = TorchSDPABackend()  # default tile: 1024 keys
    out: list[torch.Tensor] = []

    def call():
        out.append(backend.forward(query, key, value, kv_cache, md, scale=D**-0.5))

    def reference() -> torch.Tensor:
        # Dense float64 attention over the whole sequence (after the call wrote the chunk's K/V).
        k = kv_cache[0].reshape(-1, HKV, D)[:seq_len].double().repeat_interleave(H // HKV, dim=1)
        v = kv_cache[1].reshape(-1, HKV, D)[:seq_len].double().repeat_interleave(H // HKV, dim=1)
        s = torch.einsum("qhd,khd->hqk", query.double(), k) * D**-0.5
        qpos = torch.arange(context_len, seq_len)[:, None]
        s = s.masked_fill(torch.arange(seq_len)[None, :] > qpos, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    return call, out, reference


def test_torch_sdpa_peak_memory_bounded_by_chunk_not_context():
    peaks = {}
    # Both contexts span several 1024-key tiles (one tile takes a plain-softmax path).
    short_len, long_len = 2048 - CHUNK, SDPA_MAX_LEN - CHUNK
    for context_len in (short_len, long_len):
        call, out, reference = _chunk_over_context(context_len)
        peaks[context_len] = peak_cpu_bytes(call)
        torch.testing.assert_close(out[0].double(), reference(), atol=1e-4, rtol=1e-4)
    short, long = peaks[short_len], peaks[long_len]
    # What one float32 [heads, chunk, context] score matrix would take at max_model_len.
    full_scores = H * CHUNK * SDPA_MAX_LEN * 4
    # 4x the context, (nearly) the same peak: it tracks the tile, not the context.
    assert long < 1.25 * short, (short, long)
    assert long < full_scores / 2, (long, full_scores)  # measured: ~0.3
