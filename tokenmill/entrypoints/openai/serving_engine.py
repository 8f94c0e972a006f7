"""What both OpenAI endpoints share: model-name checks, batched prompts, the response and SSE shells.

One HTTP request becomes one engine request per prompt (the engine runs
n > 1 as n children and gathers them), all feeding one `OutputStream`.
Choice index of prompt `p`, sample `j`: `p * n + j`, as OpenAI numbers
batched completions. `OpenAIServing.full_response` and `stream_response`
drive both endpoints; a handler supplies only its choices
(`final_choice`, `stream_choices`) and its response type.

The engine is asked for FINAL_ONLY outputs (one per request) when not
streaming and for DELTA outputs (only what is new since the request's
previous output) when streaming, as vLLM's servers do: a CUMULATIVE output
copies the whole text, token ids and logprobs so far at every step, O(length)
work per token. So a stream handler never sees the whole output: what it
needs of the past it keeps itself (`ChoiceState`'s counters, the parsers'
text in `ChoiceStreamer`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec
from pydantic import BaseModel

from tokenmill.entrypoints.openai.errors import ModelNotFoundError
from tokenmill.entrypoints.openai.protocol import UsageInfo, random_id
from tokenmill.frontend.output_stream import append_delta_completion
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import InvalidFieldError, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# The lowest logprob the OpenAI server reports (vLLM's clamp): -inf has no JSON number.
LOGPROB_FLOOR = -9999.0


class EngineClient(Protocol):
    """The part of `AsyncLLM` the HTTP layer uses (a fake implements it in tests)."""

    tokenizer: Any
    max_model_len: int
    default_sampling_kwargs: dict[str, Any]

    def add_request(self, request_id: str, prompt: Any, sampling_params: SamplingParams, priority: int = 0,
                    stream: Any = None) -> Any: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]: ...


@dataclass(slots=True)
class ChoiceState:
    """One choice: what its outputs held so far and what a stream has already sent of it."""

    index: int
    prompt_index: int
    num_text_chars: int = 0  # chars of text already sent
    num_tokens: int = 0  # token ids already sent
    num_logprobs: int = 0  # logprob positions already sent
    num_generated: int = 0  # token ids recorded (sent or not): usage.completion_tokens
    finished: bool = False
    # The latest output recorded: the whole completion (FINAL_ONLY), or the
    # new part since the previous output (DELTA, streaming).
    last: CompletionOutput | None = None


@dataclass(slots=True)
class Submission:
    """The engine requests behind one HTTP request."""

    stream: Any  # OutputStream
    n: int
    # engine request id -> prompt index
    prompt_index: dict[str, int] = field(default_factory=dict)
    # choice index -> its state
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    # prompt index -> number of prompt tokens
    prompt_lens: dict[int, int] = field(default_factory=dict)
    # prompt index -> prompt text (for echo), when known
    prompt_texts: dict[int, str | None] = field(default_factory=dict)
    # prompt index -> prompt token ids
    prompt_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # prompt index -> prompt tokens served from the prefix cache
    cached_tokens: dict[int, int] = field(default_factory=dict)
    # prompt index -> RequestOutput.prompt_logprobs (when prompt_logprobs was asked)
    prompt_logprobs: dict[int, list[PositionLogprobs | None]] = field(default_factory=dict)

    def record(self, out: RequestOutput) -> list[tuple[ChoiceState, CompletionOutput]]:
        """Note `out` (DELTA or FINAL_ONLY) and return its (choice, completion) pairs.

        Token counts add up over a request's outputs: right for DELTA, and
        for FINAL_ONLY, whose one output holds everything.
        """
        p_idx = self.prompt_index[out.request_id]
        self.prompt_lens[p_idx] = len(out.prompt_token_ids)
        self.prompt_token_ids[p_idx] = out.prompt_token_ids
        self.cached_tokens[p_idx] = out.num_cached_tokens
        if out.prompt is not None:
            self.prompt_texts[p_idx] = out.prompt
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[p_idx] = out.prompt_logprobs
        pairs = []
        for comp in out.outputs:
            choice = self.choices[p_idx * self.n + comp.index]
            choice.last = comp
            choice.num_generated += len(comp.token_ids)
            pairs.append((choice, comp))
        return pairs

    def record_ready(self, outs: list[RequestOutput]) -> list[tuple[ChoiceState, CompletionOutput]]:
        """`record` each of `outs` (DELTA, in order); return each touched choice once, with all its new output.

        A stream that fell behind sends one chunk per choice for all its
        pending outputs: several deltas of one choice are joined into the first
        one (`output_stream.append_delta_completion`, as `OutputStream` merges them).
        """
        latest: dict[int, tuple[ChoiceState, CompletionOutput]] = {}
        for out in outs:
            for choice, comp in self.record(out):
                prev = latest.get(choice.index)
                if prev is not None:  # `prev`'s completion is an earlier output's, read by no one else
                    append_delta_completion(prev[1], comp)
                    comp = prev[1]
                latest[choice.index] = (choice, comp)
        return list(latest.values())

    def usage_dict(self) -> dict[str, Any]:
        """`usage().model_dump()` without the model (built for every chunk with continuous usage stats)."""
        p, c = self.num_prompt_tokens(), self.num_completion_tokens()
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens()}}

    def ordered_choices(self) -> list[ChoiceState]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens.values())

    def num_completion_tokens(self) -> int:
        return sum(c.num_generated for c in self.choices.values())

    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, over all prompts (`usage.prompt_tokens_details`)."""
        return sum(self.cached_tokens.values())

    def usage(self) -> UsageInfo:
        """The `usage` object of a response or of the last stream chunk: token counts so far."""
        return UsageInfo.model_validate(self.usage_dict())


# Sequences (prompts x n) one HTTP request may start: a bound on what one
# client can make the server allocate, far above real batched requests.
MAX_SEQS_PER_REQUEST = 4096


class OpenAIServing:
    """Base of the completion and chat handlers: checks, queueing, and the two response shells.

    A handler sets `response_type` and `chunk_object` and implements
    `start`, `final_choice` and `stream_choices`.

    Args:
        engine: the `EngineClient`.
        served_model_names: names clients may put in `model` (first = default).
        max_logprobs: largest logprobs / top_logprobs a request may ask for.
        max_n: largest `n` (default: the engine's max_num_seqs, else 128).
    """

    # the model `full_response` returns (its fields: id, model, choices, usage)
    response_type: ClassVar[type[BaseModel]]
    # the `object` field of every stream chunk
    chunk_object: ClassVar[str]

    def __init__(self, engine: EngineClient, served_model_names: list[str], max_logprobs: int = 20,
                 max_n: int | None = None) -> None:
        if not served_model_names:
            raise ValueError("At least one served model name is needed.")
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_logprobs = max_logprobs
        if max_n is None:
            sched = getattr(getattr(engine, "engine_config", None), "scheduler_config", None)
            max_n = int(getattr(sched, "max_num_seqs", 0) or 128)
        self.max_n = max_n
        self.default_sampling_kwargs: dict[str, Any] = dict(getattr(engine, "default_sampling_kwargs", None) or {})

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.engine, "vocab_size", None)

    def check_token_ids(self, token_ids: Any, field_name: str) -> None:
        """Raises ValueError when an id in `token_ids` is outside the vocabulary (when it is known)."""
        vocab = self.vocab_size
        if vocab is None or not token_ids:
            return
        bad = next((t for t in token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"{field_name} holds token id {bad}, outside this model's vocabulary 0 .. {vocab - 1}.")

    def check_sampling(self, params: SamplingParams, num_prompts: int = 1) -> None:
        """Server-side bounds the engine does not know about.

        Raises:
            ValueError: n above max_n, too many sequences in one request, or
                token ids outside the vocabulary in logit_bias / allowed_token_ids.
        """
        if params.n > self.max_n:
            raise ValueError(f"n must be at most {self.max_n} on this server (its --max-num-seqs), got {params.n}.")
        if params.n * num_prompts > MAX_SEQS_PER_REQUEST:
            raise ValueError(f"One request may start at most {MAX_SEQS_PER_REQUEST} sequences (prompts x n), got "
                             f"{num_prompts} x {params.n}; split it into several requests.")
        self.check_token_ids(list(params.logit_bias or {}), "logit_bias")
        self.check_token_ids(params.allowed_token_ids, "allowed_token_ids")

    @staticmethod
    def response_id(prefix: str, body_request_id: str | None, raw_request: Any = None) -> str:
        """The id of a response: the body's `request_id`, else `<prefix>-<X-Request-Id or a fresh id>`."""
        if body_request_id:
            return body_request_id
        state = getattr(raw_request, "state", None)
        header_id = getattr(state, "request_id", None) if state is not None else None
        return f"{prefix}-{header_id}" if header_id else random_id(prefix)

    def check_model(self, model: str | None) -> str:
        """The model name responses report: the first served name, whichever one `model` used (as vLLM).

        Raises:
            ModelNotFoundError: `model` is set and not one of ours.
        """
        if model and model not in self.served_model_names:
            raise ModelNotFoundError(model, self.served_model_names)
        return self.served_model_names[0]

    def check_logprobs(self, logprobs: int | None, field_name: str = "logprobs") -> None:
        """Raises InvalidFieldError (a ValueError naming `field_name`, the error body's param) when more top
        logprobs are asked than --max-logprobs allows."""
        if logprobs is not None and logprobs > self.max_logprobs:
            raise InvalidFieldError(field_name, f"At most {self.max_logprobs} {field_name} per token may be requested, "
                                    f"got {logprobs} (the server's --max-logprobs).")

    def check_request_fields(self, req: Any) -> None:
        """Server-side bounds of the fields both endpoints share.

        Raises:
            ValueError: prompt_logprobs above --max-logprobs, truncate_prompt_tokens
                above max_model_len, or a priority without --scheduling-policy priority.
        """
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        max_model_len = getattr(self.engine, "max_model_len", None)
        n = req.truncate_prompt_tokens
        if n is not None and max_model_len is not None and n > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({n}) is larger than this model's maximum context length "
                             f"({max_model_len} tokens); give at most {max_model_len}, or -1 for max_model_len.")
        sched = getattr(getattr(self.engine, "engine_config", None), "scheduler_config", None)
        policy = getattr(sched, "policy", None)
        if req.priority and policy is not None and policy != "priority":
            raise ValueError(f"priority {req.priority} was given, but this server schedules first come, first "
                             "served; start it with --scheduling-policy priority to use priorities.")

    def prompt_logprobs_body(self, positions: list[PositionLogprobs | None] | None,
                             as_token_ids: bool = False) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` JSON: per prompt token None (the first) or
        {token id: {logprob, rank, decoded_token}}."""
        if positions is None:
            return None
        tok = self.engine.tokenizer
        return [None if pos is None else {
            str(tid): {"logprob": max(lp.logprob, LOGPROB_FLOOR), "rank": lp.rank,
                       "decoded_token": token_text(tok, tid, lp.decoded_token, as_token_ids)}
            for tid, lp in pos.items()} for pos in positions]

    def submit(self, request_id: str, prompts: list[Any], params: SamplingParams, priority: int = 0,
               cache_salt: str | None = None) -> Submission:
        """Queue every (prompt, sample) pair as its own engine request.

        `cache_salt` (the body's field, as vLLM's) rides in a dict prompt to
        the input processor, which puts it on each engine request.

        Raises:
            ValueError: any one is invalid; the ones already queued are aborted.
        """
        # The handlers add outputs up (see `Submission.record`): a CUMULATIVE output would count twice.
        assert params.output_kind != RequestOutputKind.CUMULATIVE, "the server asks for DELTA or FINAL_ONLY"
        if cache_salt is not None:
            prompts = [_with_cache_salt(p, cache_salt) for p in prompts]
        n = params.n
        sub: Submission | None = None
        stream = None
        try:
            for p_idx, prompt in enumerate(prompts):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{p_idx}"
                stream = self.engine.add_request(engine_id, prompt, params, priority, stream)
                if sub is None:
                    sub = Submission(stream=stream, n=n)
                sub.prompt_index[engine_id] = p_idx
                for j in range(n):
                    sub.choices[p_idx * n + j] = ChoiceState(index=p_idx * n + j, prompt_index=p_idx)
        except BaseException:
            if stream is not None:
                stream.close()
            raise
        assert sub is not None
        return sub


    def final_choice(self, req: Any, sub: Submission, choice: ChoiceState, comp: CompletionOutput) -> BaseModel:
        """One choice of the full response from its finished output `comp`."""
        raise NotImplementedError

    def stream_choices(self, req: Any, sub: Submission) -> AsyncIterator[list[dict[str, Any]]]:
        """Consume `sub.stream`; yield the `choices` list of each chunk to send."""
        raise NotImplementedError

    async def full_response(self, req: Any, response_id: str, model: str, sub: Submission) -> BaseModel:
        """Wait for every choice to finish and build the response (`response_type`)."""
        try:
            async for out in sub.stream:
                sub.record(out)
        finally:
            sub.stream.close()
        choices = []
        for c in sub.ordered_choices():
            assert c.last is not None, "a finished request always has an output"
            choices.append(self.final_choice(req, sub, c, c.last))
        return self.response_type(id=response_id, model=model, choices=choices, usage=sub.usage(),
                                  **self.response_fields(req, sub))

    def response_fields(self, req: Any, sub: Submission) -> dict[str, Any]:
        """Extra top-level fields of a full response (a handler's hook; none by default)."""
        return {}

    async def stream_response(self, req: Any, response_id: str, model: str,
                              sub: Submission) -> AsyncIterator[str | bytes]:
        """SSE chunks: those of `stream_choices`, then the usage chunk when asked, then [DONE].

        `stream_options.continuous_usage_stats` (with `include_usage`, as vLLM) also puts the usage so
        far on every chunk. An error after the headers went out is reported in-band
        (`stream_error_body`), as vLLM does. Chunks are UTF-8 bytes (`SSEChunks`).
        """
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        try:
            chunk = SSEChunks(response_id, self.chunk_object, int(time.time()), model)
            async with aclosing(self.stream_choices(req, sub)) as chunks:
                async for choices in chunks:
                    yield chunk(choices, sub.usage_dict() if continuous else None)
            if include_usage:
                yield chunk([], sub.usage_dict())
        except Exception as exc:  # noqa: BLE001 - after headers: report in-band
            yield sse(stream_error_body(exc))
        finally:
            sub.stream.close()
        yield SSE_DONE


async def ready_outputs(stream: Any) -> AsyncIterator[list[RequestOutput]]:
    """The outputs of an `OutputStream`, in groups: each wait's output plus every one queued behind it."""
    while True:
        try:
            outs = await stream.next_ready()
        except StopAsyncIteration:
            return
        yield outs


class SSEChunks:
    """Builds one stream's chunk events as bytes: `data: {"id", "object", "created", "model", "choices"[, "usage"]}`.

    The fields every chunk repeats are encoded once; only `choices` (and
    `usage`) are encoded per chunk, with msgspec (compact JSON, UTF-8; the
    same values `json.dumps` gives, without the spaces and \\u escapes).
    """

    __slots__ = ("_head",)

    def __init__(self, response_id: str, chunk_object: str, created: int, model: str) -> None:
        enc = _json_encode
        self._head = (b'data: {"id":' + enc(response_id) + b',"object":' + enc(chunk_object) + b',"created":'
                      + enc(created) + b',"model":' + enc(model) + b',"choices":')

    def __call__(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        if usage is None:
            return self._head + _json_encode(choices) + b"}\n\n"
        return self._head + _json_encode(choices) + b',"usage":' + _json_encode(usage) + b"}\n\n"


def _with_cache_salt(prompt: Any, cache_salt: str) -> dict[str, Any]:
    """A text / token-id / dict prompt as a dict prompt carrying `cache_salt`."""
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": cache_salt}
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": cache_salt}
    return {"prompt_token_ids": list(prompt), "cache_salt": cache_salt}


def sse(data: Any) -> str:
    """One server-sent event: `data: <json>\\n\\n` (a pydantic model or a dict)."""
    if hasattr(data, "model_dump_json"):
        return f"data: {data.model_dump_json(exclude_unset=False)}\n\n"
    return f"data: {json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
_json_encode = msgspec.json.Encoder().encode


def stream_error_body(exc: Exception) -> dict[str, Any]:
    """The error event a stream sends when a request fails after the headers went out.

    ValueError -> 400 (the request's fault), EngineDeadError -> 503, anything
    else -> 500 (logged: it is a bug).
    """
    from tokenmill.entrypoints.openai.errors import error_body
    from tokenmill.frontend.core_client import EngineDeadError

    if isinstance(exc, ValueError):
        return error_body(str(exc), 400)
    if isinstance(exc, EngineDeadError):
        return error_body(exc.user_message(), 503)
    logger.error("unexpected error in a stream", exc_info=exc)
    return error_body(f"Internal server error: {type(exc).__name__}: {exc}", 500)


def finish_reason_text(reason: Any) -> str | None:
    """OpenAI's spelling of a finish reason ("stop", "length", "abort") or None."""
    return None if reason is None else str(reason)


def token_logprobs(tokenizer: Any, positions: list[PositionLogprobs | None], token_ids: list[int], num_top: int,
                   as_token_ids: bool = False) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
    """Per token: (its text, its logprob or None when not reported, the top `num_top` (text, logprob)).

    `positions[i]` is the logprob dict of token `token_ids[i]`, or None where
    no logprobs exist (an echoed first prompt token: logprob and top are then
    None); the top alternatives are sorted by logprob, highest first.
    Logprobs are clamped below at -9999.0, as vLLM's OpenAI server does: a
    token of probability 0 (-inf, e.g. one a logits processor masked) would
    otherwise have no JSON number.
    as_token_ids: `return_tokens_as_token_ids` ("token_id:<id>" instead of text).
    """
    out = []
    for pos, tid in zip(positions, token_ids):
        sampled = pos.get(tid) if pos is not None else None
        text = token_text(tokenizer, tid, sampled.decoded_token if sampled else None, as_token_ids)
        if pos is None:
            out.append((text, None, None))
            continue
        top = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:num_top] if num_top else []
        out.append((text, max(sampled.logprob, LOGPROB_FLOOR) if sampled else None,
                    [(token_text(tokenizer, t, lp.decoded_token, as_token_ids), max(lp.logprob, LOGPROB_FLOOR))
                     for t, lp in top]))
    return out


def token_text(tokenizer: Any, token_id: int, decoded: str | None, as_token_id: bool = False) -> str:
    """The text shown for one token in logprobs (the engine's, else decoded here).

    as_token_id: `return_tokens_as_token_ids`: "token_id:<id>" instead of text.
    """
    if as_token_id:
        return f"token_id:{token_id}"
    if decoded is not None:
        return decoded
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])
