"""bad_words: words a request must never generate, as vLLM defines them.

Front end (`tokenize_bad_words`): each word becomes up to two token-id
sequences, the word as written (leading spaces stripped) and the word after
one space, because BPE vocabularies spell a word differently mid-sentence:

    "Paris" -> [[12095]]  and  " Paris" -> [[7042]]

Worker (`bad_word_masked_ids`): before each sampled token, for every
sequence whose all-but-last tokens equal the last tokens generated (a
one-token sequence always matches), its last token is masked (-inf):

    sequence [11, 12, 13], output [..., 11, 12] -> mask 13
    sequence [11, 12, 13], output [..., 11, 99] -> nothing

Only generated tokens are matched, never the prompt (vLLM's rule).
"""

from __future__ import annotations

from typing import Any


def tokenize_bad_words(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """The token-id sequences to block for `words`.

    Args:
        tokenizer: a transformers tokenizer (encoded with add_special_tokens=False).
        words: the request's `bad_words`.
        vocab_size: the model's vocabulary size (ids at or above it are an error).

    Returns:
        Distinct non-empty sequences, the plain spelling of each word first.

    Raises:
        ValueError: there is no tokenizer, or a word tokenizes to no tokens
            (an empty or whitespace-only entry).
    """
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer, but the engine was started with skip_tokenizer_init; "
                         "use logit_bias or allowed_token_ids with token ids instead.")
    out: list[list[int]] = []
    for word in words:
        stripped = word.lstrip()
        variants = [list(tokenizer.encode(text, add_special_tokens=False)) for text in (stripped, " " + stripped)] \
            if stripped else []
        if not variants or not variants[0]:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens; remove it or give a non-blank word.")
        for ids in variants:
            if ids and ids not in out:
                if any(not 0 <= t < vocab_size for t in ids):
                    raise ValueError(f"bad_words entry {word!r} tokenizes to ids outside this model's vocabulary.")
                out.append(ids)
    return out


def bad_word_masked_ids(sequences: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """Token ids to mask at the next position, given the tokens generated so far.

    Args:
        sequences: from `tokenize_bad_words`.
        output_token_ids: the request's generated tokens (the prompt excluded).

    Returns:
        The last token of each sequence whose prefix ends `output_token_ids`
        (unordered, may repeat).
    """
    masked = []
    for seq in sequences:
        prefix = len(seq) - 1
        tail = output_token_ids[len(output_token_ids) - prefix :] if prefix <= len(output_token_ids) else None
        if prefix == 0 or tail == seq[:-1]:
            masked.append(seq[-1])
    return masked
