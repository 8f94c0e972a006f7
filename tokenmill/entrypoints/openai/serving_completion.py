"""POST /v1/completions: text (or token-id) prompts in, OpenAI completion objects or SSE chunks out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tokenmill.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from tokenmill.entrypoints.openai.serving_engine import (
    ChoiceState,
    OpenAIServing,
    Submission,
    finish_reason_text,
    token_logprobs,
)
from tokenmill.outputs import CompletionOutput, PositionLogprobs


class OpenAIServingCompletion(OpenAIServing):
    """Handler for /v1/completions."""

    response_type = CompletionResponse
    chunk_object = "text_completion"

    def start(self, req: CompletionRequest, raw_request: Any = None) -> tuple[str, str, Submission]:
        """Validate and queue the request; returns (response id, model name, submission).

        Args:
            raw_request: the HTTP request (its X-Request-Id names the response), or None.

        Raises:
            ValueError / ModelNotFoundError: client mistakes (400 / 404).
        """
        model = self.check_model(req.model)
        prompts = req.prompts()
        self.check_logprobs(req.logprobs)
        for p in prompts:
            if not isinstance(p, str):
                self.check_token_ids(p, "prompt")
        params = req.to_sampling_params(self.default_sampling_kwargs)
        self.check_sampling(params, len(prompts))
        response_id = self.response_id("cmpl", req.request_id, raw_request)
        return response_id, model, self.submit(response_id, prompts, params, req.priority or 0, req.cache_salt)

    def final_choice(self, req: CompletionRequest, sub: Submission, choice: ChoiceState,
                     comp: CompletionOutput) -> CompletionChoice:
        """The text (after the prompt when `echo`) and logprobs of one finished choice."""
        text = comp.text
        if req.echo:
            text = self._prompt_text(sub, choice.prompt_index) + text
        logprobs = self._logprobs(comp.logprobs or [], comp.token_ids, 0, req.logprobs) \
            if req.logprobs is not None else None
        return CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                finish_reason=finish_reason_text(comp.finish_reason), stop_reason=comp.stop_reason)

    async def stream_choices(self, req: CompletionRequest, sub: Submission) -> AsyncIterator[list[dict[str, Any]]]:
        """Text deltas per choice, finish reasons last."""
        async for out in sub.stream:
            for choice, comp in sub.record(out):
                chunk = self._delta_choice(req, sub, choice, comp)
                if chunk is not None:
                    yield [chunk]

    def _delta_choice(self, req: CompletionRequest, sub: Submission, choice: ChoiceState,
                      comp: CompletionOutput) -> dict[str, Any] | None:
        """The new part of one choice as a chunk choice, or None when nothing changed."""
        if choice.finished:
            return None
        prefix = ""
        if req.echo and choice.num_text_chars == 0 and choice.num_tokens == 0:
            prefix = self._prompt_text(sub, choice.prompt_index)
        delta = comp.text[choice.num_text_chars:]
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._logprobs((comp.logprobs or [])[choice.num_logprobs:],
                                      comp.token_ids[choice.num_logprobs:], choice.num_text_chars,
                                      req.logprobs).model_dump()
            choice.num_logprobs = len(comp.logprobs or [])
        finish = finish_reason_text(comp.finish_reason)
        choice.num_text_chars = len(comp.text)
        choice.num_tokens = len(comp.token_ids)
        choice.finished = finish is not None
        if not (prefix or delta or finish):
            return None
        return {"index": choice.index, "text": prefix + delta, "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": comp.stop_reason if finish else None}

    def _prompt_text(self, sub: Submission, prompt_index: int) -> str:
        """The prompt as text for `echo` (token-id prompts are decoded)."""
        text = sub.prompt_texts.get(prompt_index)
        if text is None:
            ids = sub.prompt_token_ids.get(prompt_index, [])
            tok = self.engine.tokenizer
            text = tok.decode(ids) if tok is not None and ids else ""
        return text

    def _logprobs(self, positions: list[PositionLogprobs], token_ids: list[int], text_offset: int,
                  num_top: int) -> CompletionLogprobs:
        """Legacy completions logprobs for `positions` (one dict per generated token)."""
        out = CompletionLogprobs()
        offset = text_offset
        for text, logprob, top in token_logprobs(self.engine.tokenizer, positions, token_ids, num_top):
            out.tokens.append(text)
            out.token_logprobs.append(logprob)
            out.text_offset.append(offset)
            offset += len(text)
            out.top_logprobs.append(dict(top) or None)
        return out
