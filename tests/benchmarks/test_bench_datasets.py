"""Dataset generation: lengths within vLLM's range-ratio bounds, shared prefixes, custom JSONL."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from tokenmill.benchmarks.datasets import (
    PromptMaker,
    length_bounds,
    sample_custom,
    sample_prefix_repetition,
    sample_random,
)


def test_length_bounds():
    assert length_bounds(100, 0.0) == (100, 100)
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(10, 0.33) == (6, 14)  # floor(6.7), ceil(13.3)
    with pytest.raises(ValueError, match="range-ratio"):
        length_bounds(100, 1.0)


def test_random_lengths_stay_in_bounds_and_spread(word_tokenizer):
    maker = PromptMaker(word_tokenizer, np.random.default_rng(0))
    reqs = sample_random(maker, 300, input_len=40, output_len=20, range_ratio=0.5)
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert 20 <= min(in_lens) and max(in_lens) <= 60
    assert 10 <= min(out_lens) and max(out_lens) <= 30
    assert min(in_lens) < 25 and max(in_lens) > 55  # uniform over the whole range, not a point
    # the recorded length is the prompt's real token count, and special ids never appear
    for r in reqs[:20]:
        ids = word_tokenizer.encode(r.prompt)
        assert len(ids) == r.prompt_len and 0 not in ids


def test_random_fixed_length_and_shared_prefix(word_tokenizer):
    maker = PromptMaker(word_tokenizer, np.random.default_rng(1))
    reqs = sample_random(maker, 10, input_len=12, output_len=5, prefix_len=8)
    assert {r.prompt_len for r in reqs} == {20} and {r.expected_output_len for r in reqs} == {5}
    prefixes = {tuple(r.prompt.split()[:8]) for r in reqs}
    assert len(prefixes) == 1
    assert len({r.prompt for r in reqs}) == 10


def test_random_without_tokenizer_uses_words():
    maker = PromptMaker(None, np.random.default_rng(2))
    reqs = sample_random(maker, 5, input_len=30, output_len=4)
    assert all(len(r.prompt.split()) == 30 == r.prompt_len for r in reqs)


def test_same_seed_same_prompts(word_tokenizer):
    a = sample_random(PromptMaker(word_tokenizer, np.random.default_rng(7)), 4, 10, 3, 0.3)
    b = sample_random(PromptMaker(word_tokenizer, np.random.default_rng(7)), 4, 10, 3, 0.3)
    assert a == b


def test_prefix_repetition_shares_prefixes(word_tokenizer):
    maker = PromptMaker(word_tokenizer, np.random.default_rng(3))
    reqs = sample_prefix_repetition(maker, num_prompts=12, prefix_len=6, suffix_len=4, num_prefixes=3,
                                    output_len=7)
    assert len(reqs) == 12
    assert all(r.prompt_len == 10 and r.expected_output_len == 7 for r in reqs)
    counts = Counter(tuple(r.prompt.split()[:6]) for r in reqs)
    assert sorted(counts.values()) == [4, 4, 4]
    assert len({r.prompt for r in reqs}) == 12  # suffixes differ
    first_prefixes = [tuple(r.prompt.split()[:6]) for r in reqs]
    assert first_prefixes != sorted(first_prefixes, key=list(counts).index)  # shuffled, not grouped
    with pytest.raises(ValueError, match="num-prefixes"):
        sample_prefix_repetition(maker, 2, 6, 4, 3, 7)


def test_custom_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello there world", "output_tokens": 9}) + "\n\n"
                    + json.dumps({"prompt": "one two"}) + "\n")
    reqs = sample_custom(PromptMaker(None, np.random.default_rng(0)), str(path), 5, output_len=33)
    assert [r.expected_output_len for r in reqs] == [9, 33, 9, 33, 9]
    assert [r.prompt_len for r in reqs[:2]] == [3, 2]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=":1 needs"):
        sample_custom(PromptMaker(None, np.random.default_rng(0)), str(path), 1, 10)
    with pytest.raises(ValueError, match="not a file"):
        sample_custom(PromptMaker(None, np.random.default_rng(0)), str(tmp_path / "nope.jsonl"), 1, 10)
