"""POST /v1/chat/completions: messages -> chat template -> tokens; OpenAI chat objects or SSE chunks out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.engine.tokenizer import resolve_chat_template
from tokenmill.entrypoints.openai.chat_template_guard import ChatTemplatePolicy
from tokenmill.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    PromptTokenUsageInfo,
    TopLogprob,
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
from tokenmill.entrypoints.openai.tool_parsers.agents import ChatAgentConfig
from tokenmill.entrypoints.openai.tool_parsers.chat_output import ChoiceStreamer
from tokenmill.outputs import CompletionOutput, PositionLogprobs


class OpenAIServingChat(OpenAIServing):
    """Handler for /v1/chat/completions."""

    def __init__(self, *args: Any, chat_template: str | None = None, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 template_policy: ChatTemplatePolicy | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The operator's --chat-template (a file or text), read once; request templates are text only.
        self.chat_template = resolve_chat_template(chat_template)
        self.template_policy = template_policy or ChatTemplatePolicy()
        # Tool calling and reasoning (tool_parsers/, reasoning/): names checked at start-up.
        self.agents = ChatAgentConfig(enable_auto_tool_choice, tool_call_parser, reasoning_parser)

    def start(self, req: ChatCompletionRequest, raw_request: Any = None) -> tuple[str, str, Submission]:
        """Validate, render the template, queue; returns (response id, model name, submission).

        Raises:
            ValueError / ModelNotFoundError: client mistakes (400 / 404).
        """
        model = self.check_model(req.model)
        messages = req.message_dicts()
        self.check_logprobs(req.top_logprobs)
        params = req.to_sampling_params(self.default_sampling_kwargs)
        self.check_sampling(params)
        add_generation_prompt = req.add_generation_prompt and not req.continue_final_message
        template, kwargs = self.template_policy.request_template(req.chat_template, req.chat_template_kwargs)
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        prompt_ids = self.agents.prepare(
            self.engine, req, messages, params, chat_template=template or self.chat_template,
            add_generation_prompt=add_generation_prompt,
            sanitize_control_tokens=self.template_policy.sanitize_control_tokens, **kwargs)
        response_id = self.response_id("chatcmpl", req.request_id, raw_request)
        return response_id, model, self.submit(response_id, [prompt_ids], params, req.priority or 0,
                                                 req.cache_salt)

    async def full_response(self, req: ChatCompletionRequest, response_id: str, model: str,
                            sub: Submission) -> ChatCompletionResponse:
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
            logprobs = self._logprobs(comp.logprobs or [], comp.token_ids, req.top_logprobs or 0) \
                if req.logprobs else None
            fields, finish = req._output_parser.message(comp.text, finish_reason_text(comp.finish_reason))
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(**fields),
                                      logprobs=logprobs, finish_reason=finish, stop_reason=comp.stop_reason))
        p, c_tokens = sub.num_prompt_tokens(), sub.num_completion_tokens()
        usage = UsageInfo(prompt_tokens=p, completion_tokens=c_tokens, total_tokens=p + c_tokens,
                          prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=sub.num_cached_tokens()))
        return ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=usage)

    async def stream_response(self, req: ChatCompletionRequest, response_id: str, model: str,
                              sub: Submission) -> AsyncIterator[str]:
        """SSE chunks: a role chunk per choice, content deltas, finish reasons, usage, [DONE]."""
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            body: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return sse(body)

        try:
            # OpenAI opens every choice with the assistant role and empty content.
            for c in sub.ordered_choices():
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            streamers = {c.index: req._output_parser.streamer() for c in sub.ordered_choices()}
            async for out in sub.stream:
                for choice, comp in sub.record(out):
                    for delta in self._delta_choice(req, choice, comp, streamers[choice.index]):
                        yield chunk([delta])
            if include_usage:
                p, c_tokens = sub.num_prompt_tokens(), sub.num_completion_tokens()
                yield chunk([], {"prompt_tokens": p, "completion_tokens": c_tokens, "total_tokens": p + c_tokens,
                                 "prompt_tokens_details": {"cached_tokens": sub.num_cached_tokens()}})
        except Exception as exc:  # noqa: BLE001 - after headers: report in-band, as vLLM does
            yield sse(stream_error_body(exc))
        finally:
            sub.stream.close()
        yield SSE_DONE

    def _delta_choice(self, req: ChatCompletionRequest, choice: ChoiceState, comp: CompletionOutput,
                      streamer: ChoiceStreamer) -> list[dict[str, Any]]:
        """The chunk choices for what `comp` adds: content / reasoning / tool-call deltas, finish last.

        New token ids make a chunk even when they add no text (delta `{}`), so
        the stream carries exactly one logprob entry per generated token.
        """
        if choice.finished:
            return []
        new_tokens = len(comp.token_ids) > choice.num_tokens
        logprobs = None
        if req.logprobs:
            new = (comp.logprobs or [])[choice.num_logprobs:]
            logprobs = self._logprobs(new, comp.token_ids[choice.num_logprobs:], req.top_logprobs or 0).model_dump()
            choice.num_logprobs = len(comp.logprobs or [])
        finish = finish_reason_text(comp.finish_reason)
        deltas = streamer.update(comp.text, final=finish is not None)
        choice.num_text_chars = len(comp.text)
        choice.num_tokens = len(comp.token_ids)
        choice.finished = finish is not None
        if not (deltas or finish or new_tokens):
            return []
        deltas = deltas or [{}]
        out = [{"index": choice.index, "delta": d, "logprobs": None, "finish_reason": None, "stop_reason": None}
               for d in deltas]
        out[0]["logprobs"] = logprobs
        if finish is not None:
            out[-1]["finish_reason"] = streamer.finish_reason(finish)
            out[-1]["stop_reason"] = comp.stop_reason
        return out

    def _logprobs(self, positions: list[PositionLogprobs], token_ids: list[int], num_top: int) -> ChatChoiceLogprobs:
        """Chat logprobs: per token its text, logprob, UTF-8 bytes and the top `num_top` alternatives."""
        tok = self.engine.tokenizer
        content = []
        for pos, tid in zip(positions, token_ids):
            sampled = pos.get(tid)
            text = token_text(tok, tid, sampled.decoded_token if sampled else None)
            top = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:num_top] if num_top else []
            tops = []
            for t, lp in top:
                t_text = token_text(tok, t, lp.decoded_token)
                tops.append(TopLogprob(token=t_text, logprob=lp.logprob, bytes=list(t_text.encode())))
            content.append(ChatTokenLogprob(token=text, logprob=sampled.logprob if sampled else -9999.0,
                                            bytes=list(text.encode()), top_logprobs=tops))
        return ChatChoiceLogprobs(content=content)
