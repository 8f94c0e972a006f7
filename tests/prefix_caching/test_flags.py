"""The user-facing switches: CLI flags, `LLM(...)` keywords, `priority` and `cache_salt` per request.

Runs on a tiny random Llama (dummy weights, token-id prompts) so each engine
starts in about a second.
"""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs

PROMPT = list(range(100, 140))  # 2 full blocks + 8 tokens


def _llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=256,
               kv_cache_memory_bytes="4M", **kwargs)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False)


def test_cli_flags_reach_the_configs(tiny_dir):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    default = EngineArgs.from_cli_args(parser.parse_args([]))
    assert default.enable_prefix_caching is True and default.scheduling_policy == "fcfs"
    args = EngineArgs.from_cli_args(parser.parse_args(["--no-enable-prefix-caching", "--scheduling-policy",
                                                       "priority"]))
    args.model, args.load_format, args.skip_tokenizer_init = tiny_dir, "dummy", True
    cfg = args.create_engine_config()
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.scheduler_config.policy == "priority"
    with pytest.raises(SystemExit):  # argparse rejects an unknown policy
        parser.parse_args(["--scheduling-policy", "lifo"])


def test_llm_prefix_caching_off_never_hits(tiny_dir):
    llm = _llm(tiny_dir, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, _params(), use_tqdm=False)
    outs += llm.generate({"prompt_token_ids": PROMPT}, _params(), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert llm.llm_engine.get_stats().prefix_cache_hits == 0


def test_cache_salt_in_dict_prompts_isolates(tiny_dir):
    llm = _llm(tiny_dir)
    first = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}, _params(), use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"},
                          {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"},
                          {"prompt_token_ids": PROMPT}], _params(), use_tqdm=False)
    assert first.num_cached_tokens == 0
    # Same salt: both full blocks hit. Another salt or none: nothing, though the tokens are equal.
    assert [o.num_cached_tokens for o in again] == [32, 0, 0]
    assert all(o.outputs[0].token_ids == first.outputs[0].token_ids for o in again)


def test_llm_priority_int_or_list(tiny_dir):
    llm = _llm(tiny_dir, scheduling_policy="priority", max_num_seqs=1)
    prompts = [{"prompt_token_ids": [1 + i, 2, 3]} for i in range(3)]
    assert len(llm.generate(prompts, _params(), use_tqdm=False, priority=4)) == 3
    assert len(llm.generate(prompts, _params(), use_tqdm=False, priority=[2, 0, 1])) == 3
    with pytest.raises(ValueError, match="3 prompts"):
        llm.generate(prompts, _params(), use_tqdm=False, priority=[1, 2])
    with pytest.raises(ValueError, match="integers"):
        llm.generate(prompts, _params(), use_tqdm=False, priority=[1, "high", 2])
    # Nothing was left queued by the rejected calls.
    assert not llm.llm_engine.has_unfinished_requests()
