"""Incremental detokenization never shows U+FFFD for a character split over tokens."""

from __future__ import annotations

import pytest

from tokenmill.frontend.detokenizer import IncrementalDetokenizer, decode_tokens_one_by_one

TEXTS = ["Tiếng Việt có dấu", "你好，世界", "👍🏽🎉", "mixed: ả 你 🎉 end"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_never_replacement_char(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The premise: some single tokens are not whole characters.
    assert any("\ufffd" in t for t in decode_tokens_one_by_one(tokenizer, ids))
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("Say:", add_special_tokens=False))
    chunks = [detok.decode([t]) for t in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
    assert detok.output_text == text


@pytest.mark.parametrize("text", TEXTS)
def test_multi_token_steps_reassemble(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    out = detok.decode(ids[:3]) + detok.decode(ids[3:5]) + detok.decode(ids[5:])
    assert out == text


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    ids += tokenizer.encode(" there", add_special_tokens=False)
    eos = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert "".join(skipped.decode([t]) for t in ids) == "Hi there"
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(kept.decode([t]) for t in ids) == tokenizer.decode(ids, skip_special_tokens=False)
    assert eos in kept.output_text
    spaced = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=True)
    assert "".join(spaced.decode([t]) for t in ids) == f"Hi {eos}  there"
