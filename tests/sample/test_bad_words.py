"""bad_words: the token sequences built from the words, and which token each step masks (vLLM's rule)."""

from __future__ import annotations

import pytest

from tokenmill.sample.bad_words import bad_word_masked_ids, tokenize_bad_words


class _WordTokenizer:
    """One id per known piece; " x" (with its space) and "x" are different tokens, as in byte-level BPE."""

    vocab = {"New": 1, " New": 2, " York": 3, "York": 4, "cat": 5, " cat": 6}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert add_special_tokens is False
        out, rest = [], text
        while rest:
            piece = max((p for p in self.vocab if rest.startswith(p)), key=len)
            out.append(self.vocab[piece])
            rest = rest[len(piece):]
        return out


def test_each_word_with_and_without_a_leading_space():
    tok = _WordTokenizer()
    assert tokenize_bad_words(tok, ["New York", "  cat"], vocab_size=10) == [[1, 3], [2, 3], [5], [6]]


@pytest.mark.parametrize("word", ["", "   "])
def test_a_word_that_tokenizes_to_nothing_is_refused(word):
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        tokenize_bad_words(_WordTokenizer(), ["cat", word], vocab_size=10)


def test_out_of_vocab_ids_and_no_tokenizer_are_refused():
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        tokenize_bad_words(_WordTokenizer(), ["cat"], vocab_size=6)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        tokenize_bad_words(None, ["cat"], vocab_size=10)


def test_last_token_masked_only_after_its_prefix():
    seqs = [[1, 3], [2, 3], [5], [7, 8, 9]]
    assert sorted(bad_word_masked_ids(seqs, [])) == [5]  # one-token words: always
    assert sorted(bad_word_masked_ids(seqs, [4, 1])) == [3, 5]
    assert sorted(bad_word_masked_ids(seqs, [2])) == [3, 5]
    assert sorted(bad_word_masked_ids(seqs, [7, 8])) == [5, 9]
    assert sorted(bad_word_masked_ids(seqs, [8, 7])) == [5]
    assert sorted(bad_word_masked_ids(seqs, [8])) == [5]
