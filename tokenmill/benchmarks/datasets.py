"""Benchmark prompts: random, prefix-repetition and custom (JSONL) datasets.

Each dataset returns `SampleRequest`s: the prompt text, its length in tokens
and the number of tokens to ask for. The generators follow vLLM's benchmark
datasets (`vllm/benchmarks/datasets.py`) in meaning and flag names:

- random: each prompt is `random_prefix_len` shared tokens followed by a
  random body whose length is drawn uniformly from
  `[floor(L * (1 - r)), ceil(L * (1 + r))]` for `L = random_input_len`,
  `r = random_range_ratio`; output lengths are drawn the same way.
- prefix-repetition: `num_prefixes` random prefixes, each shared by
  `num_prompts // num_prefixes` prompts, each followed by its own random
  suffix; shuffled. This measures prefix caching.
- custom: a JSONL file whose lines carry "prompt" and optionally
  "output_tokens".

With a tokenizer, prompts are random token ids (special tokens excluded)
decoded to text, and lengths are counted by re-encoding. Without one, prompts
are random common English words and a word counts as one token (an estimate;
the serve client then prefers the server's usage numbers).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Common, mostly single-token English words: a prompt of n of them is close
# to n tokens for BPE vocabularies, which keeps the no-tokenizer estimate fair.
_WORD_TEXT = (
    "the of and to in is was for on with as by at from his her they this that have had not are but "
    "were all one two three four five six seven eight nine ten time year people way day man woman "
    "child world life hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book eye "
    "job word business issue side kind head house service friend father power hour game line end "
    "member law car city name team minute idea body information back parent face others level office "
    "door health person art war history party result change morning reason research girl guy moment "
    "air teacher force education red blue green small large old new good great high little long"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(slots=True)
class SampleRequest:
    """One benchmark request.

    prompt: the text sent to the server.
    prompt_len: tokens in `prompt` (counted with the tokenizer, else a word count).
    expected_output_len: `max_tokens` asked for.
    """

    prompt: str
    prompt_len: int
    expected_output_len: int


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds `[floor(L(1-r)), ceil(L(1+r))]` of a sampled length (vLLM's rule).

    Raises:
        ValueError: `range_ratio` is outside [0, 1) or `length` is negative.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    if length < 0:
        raise ValueError(f"A length must be >= 0, got {length}.")
    return math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))


class PromptMaker:
    """Makes random prompt text of a given token length, with or without a tokenizer.

    Args:
        tokenizer: a transformers-like tokenizer (`encode(text, add_special_tokens=False)`,
            `decode(ids)`, `len(tokenizer)`, optional `all_special_ids`) or None.
        rng: the random generator (seeded by the caller).
    """

    def __init__(self, tokenizer: Any | None, rng: np.random.Generator):
        self.tokenizer = tokenizer
        self.rng = rng
        if tokenizer is not None:
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            ids = np.arange(len(tokenizer))
            self._allowed = ids[~np.isin(ids, list(special))] if special else ids

    def random_ids(self, n: int) -> list[int]:
        """`n` random non-special token ids (requires a tokenizer)."""
        return self.rng.choice(self._allowed, size=n).tolist()

    def text(self, n: int) -> str:
        """Random text of about `n` tokens (exactly `n` words without a tokenizer)."""
        if n <= 0:
            return ""
        if self.tokenizer is None:
            return " ".join(self.rng.choice(_WORDS, size=n).tolist())
        return self.tokenizer.decode(self.random_ids(n))

    def count(self, text: str) -> int:
        """Tokens in `text` (words without a tokenizer)."""
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def fit(self, prefix: str, body_len: int) -> tuple[str, int]:
        """Return `prefix + body` of about `count(prefix) + body_len` tokens, and its length.

        Decoding random ids and re-encoding the text can merge or split
        tokens, so a few passes truncate (too long) or append random text
        (too short) until the re-encoded length hits the target; the length
        returned is always the real count.
        """
        body = self.text(body_len)
        prompt = f"{prefix} {body}" if prefix and body else prefix + body
        if self.tokenizer is None:
            return prompt, self.count(prompt)
        target = self.count(prefix) + body_len
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        for _ in range(4):
            if len(ids) > target:
                prompt = self.tokenizer.decode(ids[:target])
            elif len(ids) < target:
                prompt = prompt + self.text(target - len(ids))
            else:
                break
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return prompt, len(ids)


def sample_random(maker: PromptMaker, num_prompts: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, prefix_len: int = 0) -> list[SampleRequest]:
    """The random dataset (vLLM `RandomDataset` semantics).

    Input lengths (excluding the shared prefix) and output lengths are drawn
    independently and uniformly from `length_bounds(len, range_ratio)`;
    output lengths are at least 1.

    Raises:
        ValueError: a length or the ratio is out of range.
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}.")
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    in_lens = maker.rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = np.maximum(maker.rng.integers(out_lo, out_hi + 1, size=num_prompts), 1)
    prefix = maker.fit("", prefix_len)[0]
    requests = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        prompt, prompt_len = maker.fit(prefix, n_in)
        requests.append(SampleRequest(prompt, prompt_len, n_out))
    return requests


def sample_prefix_repetition(maker: PromptMaker, num_prompts: int, prefix_len: int, suffix_len: int,
                             num_prefixes: int, output_len: int) -> list[SampleRequest]:
    """The prefix-repetition dataset (vLLM `PrefixRepetitionRandomDataset` semantics).

    `num_prefixes` random prefixes of `prefix_len` tokens; each is followed by
    `num_prompts // num_prefixes` different random suffixes of `suffix_len`
    tokens. The result is shuffled.

    Raises:
        ValueError: `num_prompts < num_prefixes` or a length is not positive.
    """
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(f"--num-prompts ({num_prompts}) must be >= --prefix-repetition-num-prefixes "
                         f"({num_prefixes}) >= 1, so each prefix is used at least once.")
    if output_len < 1:
        raise ValueError(f"--prefix-repetition-output-len must be >= 1, got {output_len}.")
    per_prefix = num_prompts // num_prefixes
    requests = []
    for _ in range(num_prefixes):
        prefix = maker.fit("", prefix_len)[0]
        for _ in range(per_prefix):
            prompt, prompt_len = maker.fit(prefix, suffix_len)
            requests.append(SampleRequest(prompt, prompt_len, output_len))
    order = maker.rng.permutation(len(requests))
    return [requests[i] for i in order]


def sample_custom(maker: PromptMaker, path: str, num_prompts: int, output_len: int) -> list[SampleRequest]:
    """Prompts from a JSONL file: `{"prompt": str, "output_tokens": int (optional)}` per line.

    The first `num_prompts` lines are used; a shorter file is cycled through.

    Raises:
        ValueError: the file is missing, empty, or a line is not such an object.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--dataset-path {path!r} is not a file; pass a JSONL file of {{\"prompt\": ...}} lines.")
    rows = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno} is not JSON: {e}.") from e
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{lineno} needs a string field \"prompt\".")  # noqa: TRY004 (user data)
        n_out = int(row.get("output_tokens") or output_len)
        if n_out < 1:
            raise ValueError(f"{path}:{lineno}: \"output_tokens\" must be >= 1, got {n_out}.")
        rows.append((row["prompt"], n_out))
    if not rows:
        raise ValueError(f"--dataset-path {path!r} has no prompts.")
    return [SampleRequest(prompt, maker.count(prompt), n_out)
            for prompt, n_out in (rows[i % len(rows)] for i in range(num_prompts))]


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """Load a tokenizer from a folder, hub id or `.gguf` file (tokenmill's loader when present).

    Raises:
        ValueError: it cannot be loaded.
    """
    try:
        from tokenmill.model_loader.tokenizer import load_tokenizer as _load
    except ImportError:  # the engine's loader is optional for the benchmark client
        _load = None
    if _load is not None:
        return _load(name, trust_remote_code=trust_remote_code)
    from transformers import AutoTokenizer

    p = Path(name)
    try:
        if p.suffix == ".gguf" and p.is_file():
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot load a tokenizer from {name!r}: {e}.") from e
