"""EngineCore + LLMEngine over the real Scheduler and tokenizer, with a scripted fake executor."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tokenmill.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.engine.core import EngineCore
from tokenmill.worker.kv_cache import check_max_model_len_fits
from tokenmill.executor.abstract import Executor
from tokenmill.frontend.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

SCRIPT = " The capital of France is Paris. It is a city of light and love and food."


class ScriptedExecutor(Executor):
    """Emits the tokens of SCRIPT in order for every request, whatever the prompt."""

    num_blocks = 64
    script: list[int] = []

    def __init__(self, engine_config):
        self.reqs: dict[str, dict] = {}

    def determine_num_available_blocks(self) -> int:
        return type(self).num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.initialized = num_blocks

    def execute_model(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = {"num_tokens": len(new.prompt_token_ids) + len(new.output_token_ids),
                                     "num_out": len(new.output_token_ids), "computed": new.num_computed_tokens}
        cached = so.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.reqs[rid]["computed"] = computed
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            st["computed"] += n
            assert st["computed"] <= st["num_tokens"]
            tokens = []
            if st["computed"] == st["num_tokens"]:
                tokens = [self.script[st["num_out"] % len(self.script)]]
                st["num_out"] += 1
                st["num_tokens"] += 1
            req_ids.append(rid)
            sampled.append(tokens)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def _engine_config(gguf: str, max_model_len=128, max_num_batched_tokens=256, max_num_seqs=8, block_size=16,
                   num_gpu_blocks_override=None, kv_cache_memory_bytes=None) -> EngineConfig:
    hf = SimpleNamespace(vocab_size=49152, eos_token_id=2, num_attention_heads=9, num_key_value_heads=3,
                         hidden_size=576, num_hidden_layers=30)
    mc = ModelConfig(model=gguf, model_path=gguf, gguf_file=gguf, tokenizer=gguf, skip_tokenizer_init=False,
                     load_format="gguf", dtype="float32", seed=0, max_model_len=max_model_len,
                     architecture="LlamaForCausalLM", hf_config=hf)
    return EngineConfig(mc, CacheConfig(block_size=block_size, num_gpu_blocks_override=num_gpu_blocks_override,
                                        kv_cache_memory_bytes=kv_cache_memory_bytes),
                        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
                        ParallelConfig(), DeviceConfig())


@pytest.fixture
def engine(tokenizer, smollm2_gguf):
    ScriptedExecutor.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
    return LLMEngine(_engine_config(smollm2_gguf), executor_class=ScriptedExecutor)


def _run(engine: LLMEngine) -> dict:
    done = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine did not finish")


def test_generate_length_and_stop_string(engine):
    engine.add_request("a", "Hello", SamplingParams(max_tokens=5))
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=50, stop=["Paris"]))
    done = _run(engine)
    a, b = done["a"].outputs[0], done["b"].outputs[0]
    assert a.text == " The capital of France is" and a.finish_reason == "length" and len(a.token_ids) == 5
    assert b.text == " The capital of France is " and (b.finish_reason, b.stop_reason) == ("stop", "Paris")
    # The stop string ended it in the core too: nothing left running, all blocks back.
    stats = engine.get_stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
    assert stats.max_num_running_reqs == 2


def test_n_children_and_abort(engine):
    engine.add_request("p", "Hi", SamplingParams(n=3, max_tokens=3))
    engine.add_request("x", "Hi", SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("p", "Hi", SamplingParams())
    engine.step()
    engine.abort_request("x")
    done = _run(engine)
    assert set(done) == {"p"}
    assert [c.index for c in done["p"].outputs] == [0, 1, 2]
    assert all(c.text == " The capital of" for c in done["p"].outputs)
    assert engine.get_stats().num_running_reqs == 0


def test_chunked_prefill_counted(tokenizer, smollm2_gguf):
    ScriptedExecutor.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
    eng = LLMEngine(_engine_config(smollm2_gguf, max_num_batched_tokens=16), executor_class=ScriptedExecutor)
    eng.add_request("long", [5] * 40, SamplingParams(max_tokens=2))
    done = _run(eng)
    assert len(done["long"].outputs[0].token_ids) == 2
    assert eng.num_chunked_prefill_steps > 0


def test_kv_cache_too_small_names_largest_len(smollm2_gguf, caplog):
    cfg = _engine_config(smollm2_gguf, max_model_len=128, num_gpu_blocks_override=5)
    with pytest.raises(ValueError, match="largest max_model_len that fits is 80; pass --max-model-len 80"):
        EngineCore(cfg, executor_class=ScriptedExecutor)
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.core"):
        core = EngineCore(_engine_config(smollm2_gguf, max_model_len=64, num_gpu_blocks_override=10),
                          executor_class=ScriptedExecutor)
    assert core.executor.initialized == 10
    # 30 layers * 2 * 16 tokens * 3 heads * 64 * 4 B = 737280 B per block.
    assert ("KV cache: 10 blocks x 16 tokens = 160 tokens (0.01 GiB, float32); max concurrency at "
            "max_model_len=64: 2.5x") in caplog.text


def test_check_kv_cache_fits_boundary():
    check_max_model_len_fits(4, 16, 64)
    with pytest.raises(ValueError):
        check_max_model_len_fits(3, 16, 64)


def test_kv_cache_memory_bytes_too_small_fails_before_the_model_loads(smollm2_gguf):
    """An explicit --kv-cache-memory-bytes that cannot hold one block, or one max_model_len sequence, fails
    before the executor (which loads the model) is made, with the same message as after loading."""

    class NeverBuilt:
        def __init__(self, cfg):
            raise AssertionError("the executor was made: the model would have loaded first")

    with pytest.raises(ValueError, match="smaller than one KV block of this model"):
        EngineCore(_engine_config(smollm2_gguf, max_model_len=128, kv_cache_memory_bytes=1024),
                   executor_class=NeverBuilt)
    # 30 layers * 2 * 16 tokens * 3 heads * 64 * 4 B = 737280 B per block: 5 blocks hold 80 tokens.
    with pytest.raises(ValueError, match="largest max_model_len that fits is 80; pass --max-model-len 80"):
        EngineCore(_engine_config(smollm2_gguf, max_model_len=128, kv_cache_memory_bytes=5 * 737280 + 100),
                   executor_class=NeverBuilt)

def test_cpu_kv_cache_larger_than_the_memory_fails_before_the_model_loads(smollm2_gguf, monkeypatch):
    """On CPU an explicit size over the available memory (the cache is committed lazily, as it fills)."""
    from tokenmill.platforms import memory

    class NeverBuilt:
        def __init__(self, cfg):
            raise AssertionError("the executor was made: the model would have loaded first")

    monkeypatch.setattr(memory, "host_available_bytes", lambda root="/": (8 * 2**30, "MemAvailable"))
    too_big = 8 * 2**30
    with pytest.raises(ValueError, match=rf"The CPU KV cache needs {too_big} bytes .* --kv-cache-memory-bytes"):
        EngineCore(_engine_config(smollm2_gguf, max_model_len=128, kv_cache_memory_bytes=too_big),
                   executor_class=NeverBuilt)
