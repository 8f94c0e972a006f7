"""OpenAI API request/response models (pydantic), with vLLM's extra sampling fields.

Field names and meanings follow OpenAI's Completions and Chat Completions
API references, plus vLLM's extensions (top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos, include_stop_str_in_output,
skip_special_tokens, ...). Pydantic checks types and the cheap bounds; the
value ranges are checked once, by `SamplingParams` (a `ValueError`, HTTP 400).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_serializer, model_validator

from tokenmill.entrypoints.openai.request_fields import check_undeclared_fields
from tokenmill.sampling_params import InvalidFieldError, RequestOutputKind, SamplingParams
from tokenmill.structured_output.request import structured_outputs_from_fields

# Seeds are 64-bit (signed or unsigned) values, as vLLM accepts.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# More completions per request than this is a mistake, not a workload (the
# server also caps n at its --max-num-seqs).
MAX_N = 128
# Integer fields the engine stores in int32/int64 arrays or sends over msgpack:
# bounded here so an absurd value is a 400, never an overflow in the engine.
_INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT32_MAX)]


def _finite(default: Any = None, **bounds: Any) -> Any:
    """A float field that refuses NaN and +-Infinity (Python's JSON parser accepts them)."""
    return Field(default=default, allow_inf_nan=False, **bounds)


def random_id(prefix: str) -> str:
    """An OpenAI-style id such as `chatcmpl-<32 hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# ---------------------------------------------------------------- models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Fields not declared here are refused, logged as ignored, or logged as
    unknown before validation (request_fields.py).
    """

    _endpoint: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _undeclared_fields(cls, data: Any) -> Any:
        check_undeclared_fields(data, set(cls.model_fields), cls._endpoint)
        return data

    model: str | None = None
    # None (omitted or null): the rest of the context; 0 or less: 400 (see docs/server.md).
    max_tokens: int | None = None
    temperature: float | None = _finite()
    top_p: float | None = _finite()
    n: int | None = Field(default=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true (as vLLM and OpenAI).")
        return v
    presence_penalty: float | None = _finite(0.0)
    frequency_penalty: float | None = _finite(0.0)
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    # OpenAI's end-user id: abuse-monitoring metadata, nothing to do here (vLLM ignores it too).
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=_INT32_MAX)
    min_p: float | None = _finite()
    repetition_penalty: float | None = _finite()
    min_tokens: int | None = Field(default=0, ge=0, le=_INT32_MAX)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # Logprobs of each prompt token (top-k per position); at most --max-logprobs.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=_INT32_MAX)
    # Keep the last N prompt tokens (-1: max_model_len); above max_model_len: 400.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=_INT32_MAX)
    # Logprobs' tokens shown as "token_id:<id>" (for tokens that do not decode to text on their own).
    return_tokens_as_token_ids: bool | None = None
    priority: int | None = Field(default=0, ge=-_INT32_MAX, le=_INT32_MAX)
    # vLLM: mixed into the first block's hash, so only requests with the same salt share prefix-cache blocks.
    cache_salt: str | None = Field(default=None, min_length=1)
    request_id: str | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                out[int(key)] = float(bias)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {key!r}.") from None
        return out

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int | None,
                         defaults: dict[str, Any] | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """Build `SamplingParams`; the shared part of both endpoints.

        Args:
            max_tokens: the endpoint's max-tokens field (None if omitted).
            logprobs: top logprobs per token (None: none).
            prompt_logprobs: top logprobs per prompt token (None: none).
            default_max_tokens: the endpoint's default when neither the client
                nor the generation config gives one.
            defaults: the model's generation-config sampling defaults
                (`get_default_sampling_kwargs`), used for omitted fields.

        Raises:
            ValueError: a value is out of range (from `SamplingParams`).
        """
        d = dict(defaults or {})
        d.setdefault("max_tokens", default_max_tokens)

        def pick(name: str, value: Any, neutral: Any) -> Any:
            return value if value is not None else d.get(name, neutral)

        # Children of an n > 1 request use seed + i; folding into [0, 2^63)
        # keeps every child seed a valid 64-bit generator seed.
        seed = None if self.seed is None else self.seed % 2**63
        return SamplingParams(
            n=1 if self.n is None else self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty, 1.0),
            temperature=pick("temperature", self.temperature, 1.0),
            top_p=pick("top_p", self.top_p, 1.0),
            top_k=pick("top_k", self.top_k, 0),
            min_p=pick("min_p", self.min_p, 0.0),
            seed=seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            max_tokens=pick("max_tokens", max_tokens, None),
            min_tokens=self.min_tokens or 0,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens is not False,
            spaces_between_special_tokens=self.spaces_between_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=prompt_logprobs,
            # Streams want only what is new at each step (DELTA, as vLLM: a
            # CUMULATIVE output copies the whole output so far every step);
            # the handlers keep what they need of the past. Non-streaming wants one output.
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs_from_fields(
                self.response_format, self.structured_outputs,
                {k: getattr(self, k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}),
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions body.

    `echo` with `logprobs` also returns the prompt tokens' logprobs (first
    token: None), as lm-eval's loglikelihood requests need; `echo` with
    `max_tokens: 0` returns the prompt alone (one token is generated and
    dropped, as vLLM does).
    """

    _endpoint: ClassVar[str] = "/v1/completions"

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) without a completion."""
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids).

        Raises:
            ValueError: empty prompt list, or an empty prompt.
        """
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif not p:
            raise ValueError("prompt must not be empty.")
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        for x in prompts:
            if len(x) == 0:
                raise ValueError("prompt must not be empty.")
        return prompts

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for this request (max_tokens omitted or null: the rest of the context).

        Args:
            defaults: generation-config sampling defaults for omitted fields.

        Raises:
            ValueError: a value is out of range, or an unsupported option is set.
        """
        if self.suffix:
            raise ValueError("suffix is not supported.")
        if self.best_of is not None and self.best_of != (1 if self.n is None else self.n):
            raise ValueError("best_of is not supported; leave it unset or equal to n.")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, None, defaults, prompt_logprobs)


class ChatToolCallFunction(OpenAIModel):
    name: str
    # OpenAI sends a JSON string; some clients send the object itself.
    arguments: str | dict[str, Any] = "{}"


class ChatToolCall(OpenAIModel):
    """An earlier call in an assistant message (OpenAI's `tool_calls[]`)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ChatToolCallFunction


class ChatContentPart(OpenAIModel):
    """One part of a list `content`; only `text` parts are supported (checked in `message_dicts`)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    """A message; the fields a template or tool handling reads are typed, others pass through as given."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions body.

    `documents` and `chat_template_kwargs` reach the chat template;
    `add_special_tokens` (default False: the template writes BOS) adds the
    tokenizer's special tokens around the rendered prompt.
    """

    _endpoint: ClassVar[str] = "/v1/chat/completions"

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # low | medium | high (harmony models; others: a template variable)
    # Set by the chat handler: how this request's output is parsed (tool_parsers.chat_output).
    _output_parser: Any = PrivateAttr(default=None)

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as template input: text parts of list content joined.

        Raises:
            ValueError: no messages, or a non-text content part.
        """
        if not self.messages:
            raise InvalidFieldError("messages", "messages must contain at least one message.")
        out = []
        for i, m in enumerate(self.messages):
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise ValueError(f"messages[{i}].content: only text parts are supported, got type "
                                         f"{part.type!r}.")
                    texts.append(part.text)
                d["content"] = "\n".join(texts)
            elif m.content is None:
                d["content"] = ""
            out.append(d)
        return out

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for this request (default max_tokens: the rest of the context).

        Args:
            defaults: generation-config sampling defaults for omitted fields.

        Raises:
            ValueError: a value is out of range.
        """
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true.")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        explicit = "add_generation_prompt" in self.model_fields_set
        if self.continue_final_message and self.add_generation_prompt and explicit:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true; set "
                             "add_generation_prompt to false to continue the last message.")
        return self._sampling_params(max_tokens, logprobs, None, defaults, self.prompt_logprobs)


# ---------------------------------------------------------------- responses


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionLogprobs(BaseModel):
    """Completions' legacy logprobs object (parallel lists)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One candidate at one prompt position (vLLM's `prompt_logprobs` entries)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: None for the first, else token id (as a JSON key) -> PromptLogprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_unused(self, handler: Any) -> dict[str, Any]:
        # reasoning_content / tool_calls appear only when a parser produced them.
        d = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if not d.get(key):
                d.pop(key, None)
        return d


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
