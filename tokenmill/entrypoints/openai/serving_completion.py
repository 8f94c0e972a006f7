"""POST /v1/completions: text (or token-id) prompts in, OpenAI completion objects or SSE chunks out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokenUsageInfo,
    UsageInfo,
)
from tokenmill.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChoiceState,
    OpenAIServing,
    Submission,
    finish_reason_text,
    sse,
    stream_error_body,
    token_text,
)
from tokenmill.outputs import CompletionOutput, PositionLogprobs


class OpenAIServingCompletion(OpenAIServing):
    """Handler for /v1/completions."""

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

    async def full_response(self, req: CompletionRequest, response_id: str, model: str,
                            sub: Submission) -> CompletionResponse:
        """Wait for every choice to finish and build the response."""
        try:
            async for out in sub.stream:
                sub.record(out)
        finally:
            sub.stream.close()
        choices = []
        for c in sub.ordered_choices():
            comp = c.last
            assert comp is not None, "a finished request always has an output"
            text = comp.text
            if req.echo:
                text = self._prompt_text(sub, c.prompt_index) + text
            logprobs = self._logprobs(comp.logprobs or [], comp.token_ids, 0, req.logprobs) \
                if req.logprobs is not None else None
            choices.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                            finish_reason=finish_reason_text(comp.finish_reason),
                                            stop_reason=comp.stop_reason))
        prompt_tokens, completion_tokens = sub.num_prompt_tokens(), sub.num_completion_tokens()
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens,
                          prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=sub.num_cached_tokens()))
        return CompletionResponse(id=response_id, model=model, choices=choices, usage=usage)

    async def stream_response(self, req: CompletionRequest, response_id: str, model: str,
                              sub: Submission) -> AsyncIterator[str]:
        """SSE chunks: text deltas per choice, finish reasons, optional usage chunk, [DONE]."""
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            async for out in sub.stream:
                for choice, comp in sub.record(out):
                    chunk = self._delta_choice(req, sub, choice, comp)
                    if chunk is not None:
                        yield sse({"id": response_id, "object": "text_completion", "created": created,
                                   "model": model, "choices": [chunk]})
            if include_usage:
                p, c = sub.num_prompt_tokens(), sub.num_completion_tokens()
                yield sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": UsageInfo(
                               prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                               prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=sub.num_cached_tokens()),
                           ).model_dump()})
        except Exception as exc:  # noqa: BLE001 - after headers: report in-band, as vLLM does
            yield sse(stream_error_body(exc))
        finally:
            sub.stream.close()
        yield SSE_DONE

    def _delta_choice(self, req: CompletionRequest, sub: Submission, choice: ChoiceState,
                      comp: CompletionOutput) -> dict[str, Any] | None:
        """The new part of one choice as a chunk choice, or None when nothing changed.

        New token ids make a chunk even when they add no text (a skipped special
        token, the first bytes of a multi-byte character held back), so the
        stream carries exactly one logprob entry per generated token.
        """
        if choice.finished:
            return None
        new_tokens = len(comp.token_ids) > choice.num_tokens
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
        if not (prefix or delta or finish or new_tokens):
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
        tok = self.engine.tokenizer
        out = CompletionLogprobs()
        offset = text_offset
        for pos, tid in zip(positions, token_ids):
            sampled = pos.get(tid)
            text = token_text(tok, tid, sampled.decoded_token if sampled else None)
            out.tokens.append(text)
            out.token_logprobs.append(sampled.logprob if sampled else None)
            out.text_offset.append(offset)
            offset += len(text)
            top = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:num_top] if num_top else []
            out.top_logprobs.append({token_text(tok, t, lp.decoded_token): lp.logprob for t, lp in top} or None)
        return out
