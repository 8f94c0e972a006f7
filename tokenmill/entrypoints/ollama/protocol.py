"""Ollama API request bodies and the mapping of Ollama's `options` to `SamplingParams`.

Source of the shapes: Ollama's API reference (docs/api.md in ollama/ollama).
Option names mapped (others Ollama knows, e.g. num_keep or mirostat, are
accepted and ignored, as Ollama ignores options a runner does not use):

    num_predict     -> max_tokens   (-1 or -2: until the context is full)
    num_ctx         -> context window: min(num_ctx, --max-model-len) bounds prompt + output
    temperature, top_p, top_k, min_p, seed, stop -> the same SamplingParams fields
    repeat_penalty  -> repetition_penalty
    presence_penalty, frequency_penalty -> the same
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import RequestOutputKind, SamplingParams

_INT32_MAX = 2**31 - 1


class OllamaOptions(BaseModel):
    """The `options` object (unknown keys are ignored)."""

    model_config = ConfigDict(extra="ignore")

    num_predict: int | None = Field(default=None, ge=-2, le=_INT32_MAX)
    num_ctx: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    temperature: float | None = Field(default=None, allow_inf_nan=False)
    top_p: float | None = Field(default=None, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(default=None, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: list[str] | str | None = None
    repeat_penalty: float | None = Field(default=None, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)

    def to_sampling_params(self, num_prompt_tokens: int, max_model_len: int, stream: bool,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for a prompt of `num_prompt_tokens` tokens.

        Raises:
            ValueError: the prompt does not fit the context (num_ctx or
                --max-model-len), or a value is out of range.
        """
        d = dict(defaults or {})
        context = min(self.num_ctx, max_model_len) if self.num_ctx else max_model_len
        room = context - num_prompt_tokens
        if room < 1:
            raise ValueError(f"The prompt has {num_prompt_tokens} tokens, which leaves no room for output in a "
                             f"context of {context} tokens (num_ctx / --max-model-len).")
        max_tokens = room if self.num_predict is None or self.num_predict < 0 else min(self.num_predict, room)
        if max_tokens == 0:
            raise ValueError("num_predict 0 asks for no output; give a positive number (or -1 for no limit).")

        def pick(name: str, value: Any, neutral: Any) -> Any:
            return value if value is not None else d.get(name, neutral)

        return SamplingParams(
            temperature=pick("temperature", self.temperature, 0.8),  # Ollama's default temperature
            top_p=pick("top_p", self.top_p, 1.0),
            top_k=pick("top_k", self.top_k, 0),
            min_p=pick("min_p", self.min_p, 0.0),
            repetition_penalty=pick("repetition_penalty", self.repeat_penalty, 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=None if self.seed is None else self.seed % 2**63,
            stop=self.stop,
            max_tokens=max_tokens,
            # A stream sends each step's new text (DELTA); a whole answer waits for the end.
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )


class _OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool | None = True
    options: OllamaOptions | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class GenerateRequest(_OllamaRequest):
    """POST /api/generate."""

    prompt: str | None = None
    system: str | None = None
    raw: bool | None = False
    images: list[str] | None = None
    suffix: str | None = None


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | None = ""
    images: list[str] | None = None


class ChatRequest(_OllamaRequest):
    """POST /api/chat."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None  # older clients
