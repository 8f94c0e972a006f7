"""POST /v1/chat/completions: messages -> chat template -> tokens; OpenAI chat objects or SSE chunks out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tokenmill.entrypoints.openai.chat_template_guard import ChatTemplatePolicy
from tokenmill.entrypoints.openai.harmony.chat import HarmonyChat, uses_harmony
from tokenmill.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from tokenmill.entrypoints.openai.serving_engine import (
    ChoiceState,
    OpenAIServing,
    Submission,
    finish_reason_text,
    ready_outputs,
    token_logprobs,
)
from tokenmill.entrypoints.openai.tool_parsers.agents import ChatAgentConfig, idle_parser_warning
from tokenmill.entrypoints.openai.tool_parsers.chat_output import ChoiceStreamer
from tokenmill.frontend.chat_template import resolve_chat_template
from tokenmill.outputs import CompletionOutput, PositionLogprobs


class OpenAIServingChat(OpenAIServing):
    """Handler for /v1/chat/completions."""

    response_type = ChatCompletionResponse
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args: Any, chat_template: str | None = None, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 template_policy: ChatTemplatePolicy | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The operator's --chat-template (a file or text), read once; request templates are text only.
        self.chat_template = resolve_chat_template(chat_template)
        self.template_policy = template_policy or ChatTemplatePolicy()
        # Tool calling and reasoning (tool_parsers/, reasoning/): names checked at start-up.
        self.agents = ChatAgentConfig(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
        # gpt-oss (or --tool-call-parser openai / --reasoning-parser openai_gptoss): harmony instead of the template.
        hf_config = getattr(getattr(self.engine, "model_config", None), "hf_config", None)
        self.harmony = HarmonyChat() if uses_harmony(hf_config, tool_call_parser, reasoning_parser) else None
        warning = idle_parser_warning(enable_auto_tool_choice, tool_call_parser, self.harmony is not None)
        if warning:
            logger.warning(warning)

    def start(self, req: ChatCompletionRequest, raw_request: Any = None) -> tuple[str, str, Submission]:
        """Validate, render the template, queue; returns (response id, model name, submission).

        Raises:
            ValueError / ModelNotFoundError: client mistakes (400 / 404).
        """
        model = self.check_model(req.model)
        messages = req.message_dicts()
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        self.check_request_fields(req)
        params = req.to_sampling_params(self.default_sampling_kwargs)
        self.check_sampling(params)
        add_generation_prompt = req.add_generation_prompt and not req.continue_final_message
        template, kwargs = self.template_policy.request_template(req.chat_template, req.chat_template_kwargs)
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        if req.documents is not None:
            kwargs["documents"] = req.documents
        if req.reasoning_effort:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if self.harmony is not None:
            prompt_ids = self.harmony.prepare(req, messages, params)
        else:
            prompt_ids = self.agents.prepare(
                self.engine, req, messages, params, chat_template=template or self.chat_template,
                add_generation_prompt=add_generation_prompt,
                sanitize_control_tokens=self.template_policy.sanitize_control_tokens, **kwargs)
        if req.add_special_tokens:
            prompt_ids = self._with_special_tokens(prompt_ids)
        response_id = self.response_id("chatcmpl", req.request_id, raw_request)
        return response_id, model, self.submit(response_id, [prompt_ids], params, req.priority or 0,
                                                 req.cache_salt)

    def final_choice(self, req: ChatCompletionRequest, sub: Submission, choice: ChoiceState,
                     comp: CompletionOutput) -> ChatChoice:
        """The message (content, reasoning, tool calls from the output parser) of one finished choice."""
        logprobs = self._logprobs(comp.logprobs or [], comp.token_ids, req.top_logprobs or 0,
                                  bool(req.return_tokens_as_token_ids)) if req.logprobs else None
        fields, finish = req._output_parser.message(parser_input(req._output_parser, comp),
                                                    finish_reason_text(comp.finish_reason))
        return ChatChoice(index=choice.index, message=ChatResponseMessage(**fields), logprobs=logprobs,
                          finish_reason=finish, stop_reason=comp.stop_reason)

    def response_fields(self, req: ChatCompletionRequest, sub: Submission) -> dict[str, Any]:
        """`prompt_logprobs` of the (one) prompt, when asked (vLLM's chat extension)."""
        if req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": self.prompt_logprobs_body(sub.prompt_logprobs.get(0),
                                                             bool(req.return_tokens_as_token_ids))}

    async def stream_choices(self, req: ChatCompletionRequest, sub: Submission) -> AsyncIterator[list[dict[str, Any]]]:
        """A role chunk per choice, then content / reasoning / tool-call deltas and finish reasons."""
        # OpenAI opens every choice with the assistant role and empty content.
        for c in sub.ordered_choices():
            yield [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]
        streamers = {c.index: req._output_parser.streamer() for c in sub.ordered_choices()}
        async for outs in ready_outputs(sub.stream):
            for choice, comp in sub.record_ready(outs):
                for delta in self._delta_choice(req, choice, comp, streamers[choice.index]):
                    yield [delta]

    def _delta_choice(self, req: ChatCompletionRequest, choice: ChoiceState, comp: CompletionOutput,
                      streamer: ChoiceStreamer) -> list[dict[str, Any]]:
        """The chunk choices for the DELTA output `comp` (what is new since the last chunk): content / reasoning /
        tool-call deltas, finish last.

        New token ids make a chunk even when they add no text (delta `{}`), so
        the stream carries exactly one logprob entry per generated token.
        """
        if choice.finished:
            return []
        new_tokens = bool(comp.token_ids)
        logprobs = None
        if req.logprobs:
            logprobs = self._logprobs(comp.logprobs or [], comp.token_ids, req.top_logprobs or 0,
                                      bool(req.return_tokens_as_token_ids)).model_dump()
            choice.num_logprobs += len(comp.logprobs or [])
        finish = finish_reason_text(comp.finish_reason)
        deltas = streamer.update(parser_input(req._output_parser, comp), final=finish is not None)
        choice.num_text_chars += len(comp.text)
        choice.num_tokens += len(comp.token_ids)
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

    def _with_special_tokens(self, prompt: Any) -> Any:
        """add_special_tokens: the tokenizer's special tokens (e.g. BOS) around the rendered prompt's ids."""
        tok = self.engine.tokenizer
        if tok is None or not isinstance(prompt, list):
            return prompt
        build = getattr(tok, "build_inputs_with_special_tokens", None)
        return list(build(prompt)) if build is not None else prompt

    def _logprobs(self, positions: list[PositionLogprobs], token_ids: list[int], num_top: int,
                  as_token_ids: bool = False) -> ChatChoiceLogprobs:
        """Chat logprobs: per token its text, logprob, UTF-8 bytes and the top `num_top` alternatives."""
        content = []
        for text, logprob, top in token_logprobs(self.engine.tokenizer, positions, token_ids, num_top, as_token_ids):
            tops = [TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in top]
            content.append(ChatTokenLogprob(token=text, logprob=logprob if logprob is not None else -9999.0,
                                            bytes=list(text.encode()), top_logprobs=tops))
        return ChatChoiceLogprobs(content=content)


def parser_input(parser: Any, comp: CompletionOutput) -> Any:
    """What an output parser reads: the token ids for harmony (its markers are special tokens), else the text.

    The whole output for `parser.message` (FINAL_ONLY), the new part for a streamer's `update` (DELTA).
    """
    return comp.token_ids if getattr(parser, "reads_token_ids", False) else comp.text
