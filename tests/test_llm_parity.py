"""The offline `LLM` against HF transformers on the real SmolLM2-135M weights, float32.

Eight prompts of different lengths (crossing the 16-token block boundary and
the chunk size) run together, 32 greedy tokens each; transformers scores each
prompt with those 32 tokens alone, teacher-forced (`hf_reference`: the same
check as against its own greedy loop, in one forward per prompt). A token may
differ only where transformers' two best logits are within 1e-3 (a near tie
that float summation order can flip); the comparison of that prompt stops there.

The same prompts run again with a token budget small enough to force
chunked prefill and with a KV cache small enough to force preemption. The
model loads once (~30 s; the session's `smollm2_llm`, shared with
test_llm_request_fields.py); those two runs rebuild only the engine's scheduler
with the smaller budget / block count, exactly as `EngineCore` builds it from
`max_num_batched_tokens` / `num_gpu_blocks_override` (the worker's larger
KV tensor is then simply not fully used).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.core.scheduler import Scheduler  # noqa: E402

pytestmark = pytest.mark.slow  # the real SmolLM2 against transformers: minutes on 2 cores

NUM_TOKENS = 32
TIE_TOL = 1e-3
BLOCK_SIZE = 16
# Token counts: inside one block, exactly one block, one past, several blocks, past the chunk size.
PROMPT_LENGTHS = [3, 16, 17, 31, 40, 58, 77, 100]
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. ",
    "To bake a simple loaf of bread you need flour, water, salt and yeast. Mix them, knead the dough for ten "
    "minutes, let it rise until doubled, shape it, and bake it in a hot oven. ",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and release oxygen. It takes place in the chloroplasts. ",
]


def _prompts(tokenizer) -> list[list[int]]:
    """Token-id prompts of PROMPT_LENGTHS, cut from the texts above (repeated to be long enough)."""
    prompts = []
    for i, n in enumerate(PROMPT_LENGTHS):
        ids = tokenizer.encode(TEXTS[i % len(TEXTS)] * 4, add_special_tokens=False)
        assert len(ids) >= n
        prompts.append(ids[:n])
    return prompts


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    """The session's SmolLM2 LLM (tests/conftest.py: float32, 16-token blocks), with a default scheduler again
    after this module (its tests swap the scheduler)."""
    assert smollm2_llm.llm_engine.engine_core.engine_config.cache_config.block_size == BLOCK_SIZE
    yield smollm2_llm
    _use_scheduler(smollm2_llm)


@pytest.fixture(scope="module")
def prompts(llm):
    return _prompts(llm.get_tokenizer())


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2):
    """reference(prompts, completions) -> per prompt: (transformers' greedy token after prompt + completion[:j],
    the gap between its two best logits there), for j < 32.

    Teacher-forced, one forward over prompt + completion[:-1] per prompt (alone: no padding). Until the first
    j where transformers' choice differs from completion[j], completion[:j] IS its own greedy output, so the
    check is the same as against its greedy loop, at one forward per prompt instead of one per token.
    Cached per (prompt, completion): the three parity runs usually generate the same tokens.
    """
    model, _ = hf_smollm2
    cache: dict[tuple, tuple[list[int], list[float]]] = {}

    def reference(prompts: list[list[int]], completions: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        for ids, completion in zip(prompts, completions):
            key = (tuple(ids), tuple(completion))
            if key not in cache:
                with torch.inference_mode():
                    logits = model(torch.tensor([ids + completion[:-1]]),
                                   logits_to_keep=len(completion)).logits[0].float()  # [32, vocab]
                top2 = torch.topk(logits, 2, dim=-1).values
                cache[key] = (logits.argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist())
        return [cache[(tuple(ids), tuple(c))] for ids, c in zip(prompts, completions)]

    return reference


def _use_scheduler(llm: LLM, num_blocks: int | None = None, **sched_overrides) -> Scheduler:
    """Give the engine a fresh scheduler (fresh counters) with the given limits. The ids of the requests the old
    one finished since its last step carry over: the worker frees their batch rows when it hears of them."""
    core = llm.llm_engine.engine_core
    assert not core.scheduler.requests, "swap schedulers only between generate() calls"
    sched_cfg = dataclasses.replace(core.engine_config.scheduler_config, **sched_overrides)
    num_blocks = num_blocks or core.engine_config.cache_config.num_gpu_blocks
    finished = core.scheduler.finished_req_ids
    core.scheduler = Scheduler(sched_cfg, core.engine_config.cache_config, num_blocks)
    core.scheduler.finished_req_ids |= finished
    return core.scheduler


def _assert_parity(llm: LLM, prompts: list[list[int]], hf_reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    for i, ours in enumerate(completions):
        assert len(ours) == NUM_TOKENS, f"prompt {i}: {len(ours)} tokens"
    for i, (ours, (ref_tokens, gaps)) in enumerate(zip(completions, hf_reference(prompts, completions))):
        for pos, (a, b) in enumerate(zip(ours, ref_tokens)):
            if a != b:
                assert gaps[pos] < TIE_TOL, (
                    f"prompt {i} (len {len(prompts[i])}) token {pos}: ours {a} != HF {b}, and HF's top-2 logit "
                    f"gap {gaps[pos]:.2e} is not a near tie\nours: {ours}\nHF:   {ref_tokens}")
                break  # after a near-tie flip the continuations legitimately diverge


def test_parity_batched(llm, prompts, hf_reference):
    sched = _use_scheduler(llm)
    _assert_parity(llm, prompts, hf_reference)
    assert sched.max_num_running_reqs > 1
    assert sched.num_preemptions == 0


def test_parity_chunked_prefill(llm, prompts, hf_reference):
    # 24 tokens per step: every prompt over 24 tokens is split over several steps.
    sched = _use_scheduler(llm, max_num_batched_tokens=24)
    _assert_parity(llm, prompts, hf_reference)
    assert sched.num_chunked_prefill_steps > 0
    assert sched.max_num_running_reqs > 1


def test_parity_preemption(llm, prompts, hf_reference):
    # 12 blocks = 192 tokens: the eight requests need ~600, so running ones get preempted and recomputed.
    max_need = (max(PROMPT_LENGTHS) + NUM_TOKENS + BLOCK_SIZE - 1) // BLOCK_SIZE
    sched = _use_scheduler(llm, num_blocks=max(12, max_need))
    _assert_parity(llm, prompts, hf_reference)
    assert sched.num_preemptions > 0
    assert sched.max_num_running_reqs > 1


def test_chat_capital_of_france(llm):
    _use_scheduler(llm)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # the model ends its answer with <|im_end|>
