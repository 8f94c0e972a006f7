"""What both OpenAI endpoints share: model-name checks, batched prompts, SSE framing.

One HTTP request becomes one engine request per prompt (the engine runs
n > 1 as n children and gathers them), all feeding one `OutputStream`.
Choice index of prompt `p`, sample `j`: `p * n + j`, as OpenAI numbers
batched completions.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.entrypoints.openai.errors import ModelNotFoundError
from tokenmill.entrypoints.openai.protocol import random_id
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
    """What a stream has already sent for one choice (delta bookkeeping)."""

    index: int
    prompt_index: int
    num_text_chars: int = 0  # chars of `text` already sent
    num_tokens: int = 0  # tokens of `token_ids` already sent
    num_logprobs: int = 0  # logprob positions already sent
    finished: bool = False
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

    def record(self, out: RequestOutput) -> list[tuple[ChoiceState, CompletionOutput]]:
        """Note `out` (cumulative or final) and return its (choice, completion) pairs."""
        p_idx = self.prompt_index[out.request_id]
        self.prompt_lens[p_idx] = len(out.prompt_token_ids)
        self.prompt_token_ids[p_idx] = out.prompt_token_ids
        self.cached_tokens[p_idx] = out.num_cached_tokens
        if out.prompt is not None:
            self.prompt_texts[p_idx] = out.prompt
        pairs = []
        for comp in out.outputs:
            choice = self.choices[p_idx * self.n + comp.index]
            choice.last = comp
            pairs.append((choice, comp))
        return pairs

    def ordered_choices(self) -> list[ChoiceState]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens.values())

    def num_completion_tokens(self) -> int:
        return sum(len(c.last.token_ids) for c in self.choices.values() if c.last is not None)

    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, over all prompts (`usage.prompt_tokens_details`)."""
        return sum(self.cached_tokens.values())


# Sequences (prompts x n) one HTTP request may start: a bound on what one
# client can make the server allocate, far above real batched requests.
MAX_SEQS_PER_REQUEST = 4096


class OpenAIServing:
    """Base of the completion and chat handlers.

    Args:
        engine: the `EngineClient`.
        served_model_names: names clients may put in `model` (first = default).
        max_logprobs: largest logprobs / top_logprobs a request may ask for.
        max_n: largest `n` (default: the engine's max_num_seqs, else 128).
    """

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
        """The model name to echo in responses.

        Raises:
            ModelNotFoundError: `model` is set and not one of ours.
        """
        if model is None or model == "":
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise ModelNotFoundError(model, self.served_model_names)
        return model

    def check_logprobs(self, logprobs: int | None) -> None:
        """Raises ValueError when more top logprobs are asked than --max-logprobs allows."""
        if logprobs is not None and logprobs > self.max_logprobs:
            raise ValueError(f"At most {self.max_logprobs} logprobs per token may be requested, got {logprobs} "
                             "(the server's --max-logprobs).")

    def submit(self, request_id: str, prompts: list[Any], params: SamplingParams, priority: int = 0,
               cache_salt: str | None = None) -> Submission:
        """Queue every (prompt, sample) pair as its own engine request.

        `cache_salt` (the body's field, as vLLM's) rides in a dict prompt to
        the input processor, which puts it on each engine request.

        Raises:
            ValueError: any one is invalid; the ones already queued are aborted.
        """
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


def stream_error_body(exc: Exception) -> dict[str, Any]:
    """The error event a stream sends when a request fails after the headers went out.

    ValueError -> 400 (the request's fault), EngineDeadError -> 503, anything
    else -> 500 (logged: it is a bug).
    """
    from tokenmill.engine.core_client import EngineDeadError
    from tokenmill.entrypoints.openai.errors import error_body

    if isinstance(exc, ValueError):
        return error_body(str(exc), 400)
    if isinstance(exc, EngineDeadError):
        return error_body(exc.user_message(), 503)
    logger.error("unexpected error in a stream", exc_info=exc)
    return error_body(f"Internal server error: {type(exc).__name__}: {exc}", 500)


def finish_reason_text(reason: Any) -> str | None:
    """OpenAI's spelling of a finish reason ("stop", "length", "abort") or None."""
    return None if reason is None else str(reason)


def token_text(tokenizer: Any, token_id: int, decoded: str | None) -> str:
    """The text shown for one token in logprobs (the engine's, else decoded here)."""
    if decoded is not None:
        return decoded
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])
