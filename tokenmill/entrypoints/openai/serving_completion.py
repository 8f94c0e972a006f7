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
    ready_outputs,
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
        self.check_request_fields(req)
        for p in prompts:
            if not isinstance(p, str):
                self.check_token_ids(p, "prompt")
        if not req.add_special_tokens:
            prompts = [self._without_special_tokens(p) for p in prompts]
        params = req.to_sampling_params(self.default_sampling_kwargs)
        self.check_sampling(params, len(prompts))
        response_id = self.response_id("cmpl", req.request_id, raw_request)
        return response_id, model, self.submit(response_id, prompts, params, req.priority or 0, req.cache_salt)

    def final_choice(self, req: CompletionRequest, sub: Submission, choice: ChoiceState,
                     comp: CompletionOutput) -> CompletionChoice:
        """The text (after the prompt when `echo`), logprobs and prompt logprobs of one finished choice."""
        as_ids = bool(req.return_tokens_as_token_ids)
        text = "" if req.echo_only else comp.text
        logprobs = None
        if req.logprobs is not None:
            positions, token_ids = ([], []) if req.echo_only else (comp.logprobs or [], comp.token_ids)
            if req.echo:
                positions, token_ids = self._echo_positions(sub, choice.prompt_index, positions, token_ids)
            logprobs = self._logprobs(positions, token_ids, 0, req.logprobs, as_ids)
        if req.echo:
            text = self._prompt_text(sub, choice.prompt_index, req.truncate_prompt_tokens is not None) + text
        prompt_logprobs = sub.prompt_logprobs.get(choice.prompt_index) if req.prompt_logprobs is not None else None
        return CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                finish_reason=finish_reason_text(comp.finish_reason), stop_reason=comp.stop_reason,
                                prompt_logprobs=self.prompt_logprobs_body(prompt_logprobs, as_ids))

    async def stream_choices(self, req: CompletionRequest, sub: Submission) -> AsyncIterator[list[dict[str, Any]]]:
        """Text deltas per choice, finish reasons last (one chunk per choice for all outputs queued at once)."""
        async for outs in ready_outputs(sub.stream):
            for choice, comp in sub.record_ready(outs):
                chunk = self._delta_choice(req, sub, choice, comp)
                if chunk is not None:
                    yield [chunk]

    def _delta_choice(self, req: CompletionRequest, sub: Submission, choice: ChoiceState,
                      comp: CompletionOutput) -> dict[str, Any] | None:
        """One choice's DELTA output `comp` (what is new since its last chunk) as a chunk choice, or None when empty.

        New token ids make a chunk even when they add no text (a skipped special
        token, the first bytes of a multi-byte character held back), so the
        stream carries exactly one logprob entry per generated token: a DELTA
        output's logprobs are those of its token ids, position for position.
        """
        if choice.finished:
            return None
        new_tokens = bool(comp.token_ids)
        prefix = ""
        first = choice.num_text_chars == 0 and choice.num_tokens == 0 and choice.num_logprobs == 0
        if req.echo and first:
            prefix = self._prompt_text(sub, choice.prompt_index, req.truncate_prompt_tokens is not None)
        delta = "" if req.echo_only else comp.text
        logprobs = None
        if req.logprobs is not None:
            positions = [] if req.echo_only else (comp.logprobs or [])
            token_ids = [] if req.echo_only else comp.token_ids
            offset = choice.num_text_chars
            if req.echo and first:
                positions, token_ids = self._echo_positions(sub, choice.prompt_index, positions, token_ids)
            logprobs = self._logprobs(positions, token_ids, offset, req.logprobs,
                                      bool(req.return_tokens_as_token_ids)).model_dump()
            choice.num_logprobs += len(comp.logprobs or [])
        finish = finish_reason_text(comp.finish_reason)
        choice.num_text_chars += len(comp.text)
        choice.num_tokens += len(comp.token_ids)
        choice.finished = finish is not None
        if not (prefix or delta or finish or new_tokens):
            return None
        return {"index": choice.index, "text": prefix + delta, "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": comp.stop_reason if finish else None}

    @staticmethod
    def _echo_positions(sub: Submission, prompt_index: int, positions: list[PositionLogprobs],
                        token_ids: list[int]) -> tuple[list[PositionLogprobs | None], list[int]]:
        """The prompt's logprob positions and ids put before the completion's (echo with logprobs)."""
        prompt_ids = sub.prompt_token_ids.get(prompt_index, [])
        prompt_lps = sub.prompt_logprobs.get(prompt_index) or [None] * len(prompt_ids)
        return [*prompt_lps, *positions], [*prompt_ids, *token_ids]

    def _without_special_tokens(self, prompt: str | list[int]) -> str | dict[str, Any]:
        """A text prompt tokenized without BOS/EOS (add_special_tokens: false); token ids pass as they are."""
        tok = self.engine.tokenizer
        if not isinstance(prompt, str) or tok is None:
            return prompt
        return {"prompt": prompt, "prompt_token_ids": list(tok.encode(prompt, add_special_tokens=False))}

    def _prompt_text(self, sub: Submission, prompt_index: int, truncated: bool = False) -> str:
        """The prompt as text for `echo` (token-id prompts, and prompts cut by truncate_prompt_tokens, are decoded)."""
        text = None if truncated else sub.prompt_texts.get(prompt_index)
        if text is None:
            ids = sub.prompt_token_ids.get(prompt_index, [])
            tok = self.engine.tokenizer
            text = tok.decode(ids) if tok is not None and ids else ""
        return text

    def _logprobs(self, positions: list[PositionLogprobs | None], token_ids: list[int], text_offset: int,
                  num_top: int, as_token_ids: bool = False) -> CompletionLogprobs:
        """Legacy completions logprobs: one entry per token; a None position (an echoed first prompt token) gives
        a None logprob and top_logprobs entry, as OpenAI's and vLLM's echo do."""
        out = CompletionLogprobs()
        offset = text_offset
        for text, logprob, top in token_logprobs(self.engine.tokenizer, positions, token_ids, num_top, as_token_ids):
            out.tokens.append(text)
            out.token_logprobs.append(logprob)
            out.text_offset.append(offset)
            offset += len(text)
            out.top_logprobs.append(None if top is None else dict(top) or None)
        return out
