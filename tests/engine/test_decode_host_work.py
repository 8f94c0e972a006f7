"""A decode step's host work does not grow with the context: no Python loop and no copy over all tokens or blocks.

One request decodes alone, once after a 256-token prompt and once after a 32,768-token one (16 and 2,048
KV blocks of 16), through the whole engine (scheduler, KV-cache manager with prefix caching, input batch,
sampler, output processor), with the model swapped for a stub (zeros for hidden states, fixed logits), so
only the host path runs. Counted per decode step, without timing:

- lines of tokenmill code executed (`sys.settrace`): a Python loop over the blocks or tokens adds one
  line event per element, 2,048 or 32,768 here;
- bytes allocated at the step's peak (`tracemalloc`, which sees Python objects and NumPy buffers): a copy
  of the token list is 256 KiB, a list of the block ids ~70 KiB, a slice of the block table over all
  MAX_NUM_SEQS rows ~66 KiB.

Both must match the short context's within a small slack. The decode steps cross two block boundaries
(a new block, a newly cached full block), so the incremental paths are exercised too.
"""

from __future__ import annotations

import json
import sys
import tracemalloc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import RequestOutputKind

SHORT, LONG = 256, 32768
DECODE_STEPS = 40  # crosses two block boundaries after a prompt that fills whole blocks
# Per-step slack over the short context: a few branches; and the one copy that follows the context by design,
# the request's block-table row mirrored to the device (4 bytes a block: 8 KiB at 32k tokens), far below a
# list of its block ids (2,048 ints: ~70 KiB), a copy of its tokens (256 KiB) or a table slice of every row.
LINE_SLACK = 20
BYTES_SLACK = 16 * 1024
MAX_NUM_SEQS = 8


class _StubModel(torch.nn.Module):
    """forward -> zeros [T, hidden]; compute_logits -> fixed random logits [N, vocab]."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.logits = torch.randn(8, vocab_size, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_long_llama")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": LONG + 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


class _StepCounter:
    """Lines of tokenmill code run and peak bytes allocated by one call."""

    def __init__(self) -> None:
        self.lines = 0

    def _trace(self, frame, event, arg):
        if "/tokenmill/" not in frame.f_code.co_filename:
            return None  # not traced inside (calls out of it are still seen: a new frame asks again)
        self.lines += event == "line"
        return self._trace

    def run(self, fn) -> tuple[int, int]:
        self.lines = 0
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        sys.settrace(self._trace)
        try:
            fn()
        finally:
            sys.settrace(None)
        return self.lines, tracemalloc.get_traced_memory()[1] - base


def _decode_costs(llm: LLM, prompt_len: int, req_id: str) -> list[tuple[int, int]]:
    """(lines, peak bytes) of each decode step of one greedy request of `prompt_len` tokens, streamed (DELTA)."""
    engine = llm.llm_engine
    ids = np.random.default_rng(prompt_len).integers(10, 246, prompt_len).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 4, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request(req_id, {"prompt_token_ids": ids}, params)
    counter, costs, tokens = _StepCounter(), [], 0
    tracemalloc.start()
    try:
        while engine.has_unfinished_requests():
            if 2 <= tokens < 2 + DECODE_STEPS:  # steady decoding (async scheduling: steps launched ahead)
                outs = []
                costs.append(counter.run(lambda: outs.extend(engine.step())))
            else:
                outs = engine.step()
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    finally:
        tracemalloc.stop()
    assert tokens == DECODE_STEPS + 4
    return costs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_step_host_work_is_independent_of_context_length(model_dir, async_scheduling):
    # max_model_len well past the long context, so the block table's copied columns stop short of its width.
    max_model_len = LONG + 2048
    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu", seed=0,
              max_model_len=max_model_len, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=8192, block_size=16,
              num_gpu_blocks_override=max_model_len // 16 + 64, enable_prefix_caching=True,
              async_scheduling=async_scheduling)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    runner.model = _StubModel(runner.hidden_size, runner.vocab_size)
    short = _decode_costs(llm, SHORT, "short")
    long = _decode_costs(llm, LONG, "long")
    assert len(short) == len(long) == DECODE_STEPS
    # Step by step: both prompts fill whole blocks, so the block boundaries fall on the same steps.
    for i, ((lines_s, bytes_s), (lines_l, bytes_l)) in enumerate(zip(short, long)):
        where = f"decode step {i}, {LONG} vs {SHORT} tokens"
        assert lines_l <= lines_s + LINE_SLACK, f"{where}: {lines_l} vs {lines_s} lines"
        assert bytes_l <= bytes_s + BYTES_SLACK, f"{where}: {bytes_l} vs {bytes_s} bytes"
    # The prefix cache still took the long prompt's blocks and the decoded ones.
    manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_blocks
    assert len(manager.block_pool.cached_block_hash_to_block) >= (LONG + DECODE_STEPS) // 16
