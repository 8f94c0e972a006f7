"""SamplingParams: how to pick each next token, with vLLM's field names and meanings.

Semantics follow vLLM's `SamplingParams` (and OpenAI's API where the fields
overlap): temperature 0 is greedy; `top_k` 0 or -1 disables top-k; `top_p` 1
and `min_p` 0 disable those filters; penalties at their neutral values
(presence/frequency 0, repetition 1) change nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

_SAMPLING_EPS = 1e-5


class InvalidFieldError(ValueError):
    """A ValueError about one request field: `param` names it (the OpenAI server puts it in the error body's
    `param`, so a client sees which field to fix)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickles across processes with both arguments
        return type(self), (self.param, str(self))


@dataclass(slots=True)
class StructuredOutputsParams:
    """What shape the output must take (vLLM's `StructuredOutputsParams` fields).

    Set exactly one of the five constraint fields:
        json: a JSON schema (dict or JSON text); the output is one JSON value
            valid against it.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these (non-empty) strings.
        grammar: EBNF (GBNF, `root ::= ...`) or Lark grammar text.
        json_object: True: any JSON object.

    reasoning_end_token_ids (tokenmill; set by the server's reasoning parser,
    not by users): token ids that end the model's thinking ("</think>"); the
    constraint applies only after them.

    Checked when the request is built (`structured_output.spec.get_spec`):
    none or several constraints, or an invalid schema / regex / grammar, is a
    `ValueError` (HTTP 400).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    reasoning_end_token_ids: list[int] | None = None


# vLLM's older name for the same parameters (`SamplingParams(guided_decoding=...)`).
GuidedDecodingParams = StructuredOutputsParams


class RequestOutputKind(IntEnum):
    """What each `RequestOutput` carries while a request runs."""

    CUMULATIVE = 0  # all text and tokens so far, each time
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, at the end


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling parameters.

    Fields (vLLM's names):
        n: number of completions returned for the prompt (>= 1).
        presence_penalty / frequency_penalty: OpenAI penalties in [-2, 2],
            subtracted from the logits of tokens already generated
            (presence once, frequency per occurrence).
        repetition_penalty: > 0; CTRL-style (Keskar et al. 2019, arXiv:1909.05858):
            logits of tokens in the prompt or output are divided by it when
            positive and multiplied when negative. 1.0 = off.
        temperature: >= 0; 0 means greedy (argmax).
        top_p: in (0, 1]; nucleus sampling (Holtzman et al. 2019).
        top_k: 0 or -1 = off, else keep the k most likely tokens.
        min_p: in [0, 1]; drop tokens with probability < min_p * max probability.
        seed: per-request generator seed; the same seed gives the same tokens
            whatever else is in the batch.
        stop: strings that end generation (not included unless
            include_stop_str_in_output).
        stop_token_ids: token ids that end generation (the token is kept in
            token_ids; its text is dropped unless it is a normal token and
            include_stop_str_in_output... as vLLM: special tokens are skipped).
        ignore_eos: keep generating after EOS.
        max_tokens: maximum tokens to generate; None = up to max_model_len.
        min_tokens: EOS and stop_token_ids are masked until this many tokens.
        logprobs: number of top logprobs per generated token (None = none;
            0 = only the sampled token's logprob).
        prompt_logprobs: number of logprobs per prompt token (None = none).
        detokenize: produce text (False: token ids only).
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: as in HF `decode`.
        include_stop_str_in_output: keep the matched stop string in the text.
        logit_bias: token id -> bias added to its logit (OpenAI semantics, [-100, 100]).
        allowed_token_ids: if set, only these tokens can be sampled.
        bad_words: words never to generate. Each is tokenized with and
            without a leading space; the last token of a variant is masked
            whenever the tokens generated just before match the rest of it
            (vLLM's rule; see `tokenmill/sample/bad_words.py`).
        truncate_prompt_tokens: keep only the last N prompt tokens (-1:
            max_model_len); None keeps the whole prompt.
        output_kind: CUMULATIVE, DELTA or FINAL_ONLY outputs while running.
        structured_outputs: constrain the output to a JSON schema, regex,
            choice list or grammar (`StructuredOutputsParams`; a dict with its
            field names is converted).
        guided_decoding: vLLM's older name for structured_outputs; moved there
            by `__post_init__` (setting both is an error).
        extra_args: opaque extra arguments (none are read by tokenmill).

    Raises:
        ValueError: from `__post_init__`, with a sentence naming the field,
            when a value is out of range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # alias, moved to structured_outputs
    # Opaque extra arguments (vLLM's field); tokenmill reads none of them.
    extra_args: dict[str, Any] | None = None
    # Filled by the engine: EOS and generation-config stop ids. Not user-set.
    all_stop_token_ids: set[int] = field(default_factory=set)
    eos_token_id: int | None = None
    # Filled by the engine from `bad_words`: the token-id sequences to block. Not user-set.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._take_structured_outputs()
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and self.seed < 0:
            # Generators take unsigned seeds; keep the same stream for the same value.
            self.seed = self.seed & 0xFFFF_FFFF_FFFF_FFFF
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _take_structured_outputs(self) -> None:
        """Normalize structured_outputs: accept a dict and the guided_decoding alias."""
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("Set structured_outputs or guided_decoding (its older name), not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        so = self.structured_outputs
        if isinstance(so, dict):
            names = set(StructuredOutputsParams.__slots__)
            unknown = sorted(set(so) - names)
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) {unknown}; "
                                 f"use {', '.join(sorted(names))}.")
            self.structured_outputs = StructuredOutputsParams(**so)
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise InvalidFieldError("structured_outputs",
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}.")
        if self.extra_args and "structured_outputs" in self.extra_args:
            raise ValueError('Structured output is the typed field SamplingParams.structured_outputs, not '
                             'extra_args["structured_outputs"]; pass structured_outputs=StructuredOutputsParams(...).')

    def _verify(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidFieldError("n", f"n must be an integer >= 1, got {self.n!r}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidFieldError("presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidFieldError("frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise InvalidFieldError("repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if not self.temperature >= 0.0:
            raise InvalidFieldError("temperature", f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidFieldError("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidFieldError("top_k", f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidFieldError("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidFieldError("max_tokens",
                f"max_tokens must be at least 1 (or None for the rest of the context), got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise InvalidFieldError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidFieldError("min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidFieldError("logprobs", f"logprobs must be >= 0, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise InvalidFieldError("prompt_logprobs", f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            raise InvalidFieldError("stop", "stop strings must not be empty.")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise InvalidFieldError("stop_token_ids", "stop_token_ids must be non-negative integers.")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100.0 <= float(bias) <= 100.0:
                    raise InvalidFieldError("logit_bias",
                        f"logit_bias values must be in [-100, 100], got {bias} for token {tok}.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise InvalidFieldError("allowed_token_ids", "allowed_token_ids must not be empty.")
        if self.bad_words is not None and not all(isinstance(w, str) for w in self.bad_words):
            raise InvalidFieldError("bad_words", "bad_words must be a list of strings.")
        if self.truncate_prompt_tokens is not None and (
                self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1):
            raise InvalidFieldError("truncate_prompt_tokens",
                f"truncate_prompt_tokens must be -1 (max_model_len) or >= 1, "
                             f"got {self.truncate_prompt_tokens}.")

    @property
    def sampling_type_greedy(self) -> bool:
        """True when sampling is argmax (temperature ~ 0)."""
        return self.temperature < _SAMPLING_EPS

    def update_from_generation_config(self, generation_config: dict[str, Any], eos_token_id: int | None) -> None:
        """Record EOS and the generation config's extra EOS ids as stop ids.

        Args:
            generation_config: the model's generation_config.json (may be {}).
            eos_token_id: the tokenizer's EOS id, or None.
        """
        self.eos_token_id = eos_token_id
        extra = generation_config.get("eos_token_id")
        ids: set[int] = set()
        if isinstance(extra, int):
            ids.add(extra)
        elif isinstance(extra, list):
            ids.update(int(x) for x in extra)
        if eos_token_id is not None:
            ids.add(eos_token_id)
        if not self.ignore_eos:
            self.all_stop_token_ids.update(ids)

    def clone(self) -> SamplingParams:
        """A deep copy (used for n > 1 children)."""
        return copy.deepcopy(self)
