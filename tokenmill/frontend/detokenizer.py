"""Incremental detokenization: token ids arrive one step at a time, text comes out.

Byte-level BPE (GPT-2, Llama 3, SmolLM2) and byte-fallback tokenizers split
one UTF-8 character over several tokens: "ế" is two tokens in SmolLM2, an emoji
three. Decoding each token alone gives U+FFFD. `tokenizers.decoders.DecodeStream`
(tokenizers >= 0.21) keeps the undecodable bytes and returns None until the
character is complete; it is seeded with the last prompt tokens so decoders
that strip a leading space (SentencePiece's Metaspace) see the context.

    ids:     [Ti] [0xE1 0xBA] [0xBF] [ng]
    stream:  "Ti"   None      "ế"    "ng"    -> "Tiếng", never "Ti\\ufffd"

`spaces_between_special_tokens` (only meaningful with skip_special_tokens=False)
follows the slow HF tokenizer convention that vLLM's slow path uses: the text
between added tokens and the added tokens themselves are joined by single
spaces ("Hi <|im_end|> there"). Fast HF `decode` ignores the flag.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream as context (enough for any decoder's lookbehind).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, step by step.

    Args:
        tokenizer: a transformers fast tokenizer (has `backend_tokenizer`).
        prompt_token_ids: the prompt, for decoding context only.
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: join added tokens and text with spaces
            (slow-tokenizer convention; only when special tokens are kept).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend_tokenizer
        # Joining with spaces means added tokens bypass the stream and are written here.
        self._join_added = (not skip_special_tokens) and spaces_between_special_tokens
        self._added_ids: dict[int, str] = {}
        if self._join_added:
            self._added_ids = {i: t for t, i in tokenizer.get_added_vocab().items()}
        skip_in_stream = skip_special_tokens or self._join_added
        context = [t for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:] if t not in self._added_ids]
        try:
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_in_stream)
        except TypeError:  # tokenizers < 0.22 has no `ids` argument
            self._stream = DecodeStream(skip_special_tokens=skip_in_stream)
        self._after_added = False  # the last piece written was an added token
        self.output_text = ""

    def decode(self, new_token_ids: list[int]) -> str:
        """Append `new_token_ids`; return the text they completed (may be "").

        Bytes of a character not yet complete are held back until the token
        that finishes it arrives, so the returned text never contains a
        U+FFFD that the full decode would not contain.
        """
        pieces: list[str] = []
        for tok in new_token_ids:
            added = self._added_ids.get(tok)
            if added is not None:
                if self.output_text or pieces:
                    pieces.append(" ")
                pieces.append(added)
                self._after_added = True
                continue
            chunk = self._stream.step(self._backend, tok)
            if chunk:
                if self._after_added:
                    pieces.append(" ")
                    self._after_added = False
                pieces.append(chunk)
        text = "".join(pieces)
        self.output_text += text
        return text


def decode_tokens_one_by_one(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each id decoded alone (special tokens kept), as logprobs' `decoded_token` shows it.

    A lone byte of a multi-byte character decodes to U+FFFD, as in vLLM and OpenAI.
    """
    if tokenizer is None:
        return [""] * len(token_ids)
    return tokenizer.backend_tokenizer.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
