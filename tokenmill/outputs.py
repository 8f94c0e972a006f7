"""What the engine returns to users: `RequestOutput` and `CompletionOutput` (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """One candidate token's log-probability at one position.

    logprob: natural log of its probability under the model's raw distribution.
    rank: 1-based rank in the vocabulary (1 = most likely).
    decoded_token: the token decoded alone (a lone byte shows as U+FFFD).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's candidates: token id -> Logprob. A list of these is one
# completion's logprobs, one dict per generated token (vLLM's SampleLogprobs).
PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt.

    index: which of the request's n completions this is (0-based).
    text: generated text (cumulative, or only what is new in DELTA mode).
    token_ids: generated token ids (same convention as `text`); a stop token
        that ended the request is included, its text is not.
    cumulative_logprob: sum of the sampled tokens' logprobs so far, or None
        when logprobs were not requested.
    logprobs: per generated token, token id -> Logprob; None when not requested.
    finish_reason: "stop", "length" or "abort" once finished, else None.
    stop_reason: the stop string or stop token id that ended it; None for EOS
        or when not stopped.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (seconds since the epoch, `time.time()`) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of one request (all its n completions) after an engine step.

    request_id: the user's request id.
    prompt: the prompt text; None for token-id prompts.
    prompt_token_ids: the prompt's token ids.
    outputs: the completions, ordered by index (in DELTA mode only those
        with something new).
    finished: every completion has finished.
    num_cached_tokens: prompt tokens served from the prefix cache.
    metrics: timing of the request.
    prompt_logprobs: with `SamplingParams.prompt_logprobs` set: one entry per
        prompt token, None for the first, then token id -> Logprob holding
        the actual token and the top-k (vLLM's PromptLogprobs); else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
