"""ChatAgentConfig: the server's tool-calling and reasoning flags, applied to each chat request.

    --enable-auto-tool-choice --tool-call-parser NAME   tool_choice "auto" + output parsing
    --reasoning-parser qwen3|deepseek_r1                 message.reasoning_content

`prepare` is the one call the chat handler makes per request: it plans the
tools, adds the forcing grammar for required/named tool_choice, renders the
prompt so the model sees the tools, and attaches a `ChatOutputParser` to
the request for the response side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.entrypoints.openai.reasoning.parsers import get_reasoning_parser
from tokenmill.entrypoints.openai.tool_parsers.chat_output import ChatOutputParser
from tokenmill.entrypoints.openai.tool_parsers.chat_tools import (
    apply_forced_tool_choice,
    plan_tools,
    render_with_tools,
)
from tokenmill.entrypoints.openai.tool_parsers.registry import get_tool_parser
from tokenmill.sampling_params import SamplingParams

_PROMPT_TAIL_TOKENS = 16  # enough to see a trailing "<think>\n"


def idle_parser_warning(enable_auto_tool_choice: bool, tool_call_parser: str | None, harmony: bool) -> str | None:
    """The start-up warning for a --tool-call-parser that does nothing, else None: as in vLLM it is accepted
    without --enable-auto-tool-choice, but it parses only tool_choice "auto", which the template path refuses
    without that flag ("required" and named tools are forced by structured output). Harmony chats (gpt-oss)
    take "auto" without the flag, so their parser does work."""
    if not tool_call_parser or enable_auto_tool_choice or harmony:
        return None
    return (f'--tool-call-parser {tool_call_parser} has no effect without --enable-auto-tool-choice (tool_choice '
            f'"auto" is refused; "required" and named tools do not use it).')


class ChatAgentConfig:
    """Server-wide settings.

    Args:
        enable_auto_tool_choice: allow tool_choice "auto".
        tool_call_parser: format parser name (hermes, qwen3_coder, llama3_json, mistral).
        reasoning_parser: qwen3 | deepseek_r1 | None.

    Raises:
        ValueError: an unknown parser name, or --enable-auto-tool-choice without --tool-call-parser.
    """

    def __init__(self, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        if tool_call_parser:
            get_tool_parser(tool_call_parser)
        if reasoning_parser:
            get_reasoning_parser(reasoning_parser)
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (e.g. hermes).")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    def prepare(self, engine: Any, req: Any, messages: list[dict[str, Any]], params: SamplingParams,
                **template_kwargs: Any) -> Any:
        """Plan tools, adjust `params` in place, render the prompt; returns what the template returned.

        Sets `req._output_parser` (a `ChatOutputParser`).

        Raises:
            ValueError: bad tools / tool_choice, or a forced tool_choice together
                with response_format / structured_outputs.
        """
        plan = plan_tools(getattr(req, "tools", None), getattr(req, "tool_choice", None),
                          self.enable_auto_tool_choice, self.tool_call_parser)
        plan.parallel_tool_calls = getattr(req, "parallel_tool_calls", None) is not False
        params.structured_outputs = apply_forced_tool_choice(plan, params.structured_outputs)
        tokenizer = getattr(engine, "tokenizer", None)
        parser = ChatOutputParser(plan, self.tool_call_parser, self.reasoning_parser, None, tokenizer)
        if parser.needs_special_tokens:
            params.skip_special_tokens = False
        prompt = render_with_tools(engine.apply_chat_template, messages, plan, **template_kwargs)
        if self.reasoning_parser:
            tail = _prompt_tail(prompt, tokenizer)
            parser.set_prompt_text(tail)
            self._grammar_after_reasoning(params, tail, tokenizer)
        req._output_parser = parser
        return prompt

    def _grammar_after_reasoning(self, params: SamplingParams, prompt_tail: str | None, tokenizer: Any) -> None:
        """Let a thinking model think first: the grammar starts after its reasoning-end tokens.

        Skipped when the prompt already closed the thinking block (e.g.
        `enable_thinking: false` renders `<think>\n\n</think>`): then the
        answer, under the grammar, starts at once.
        """
        so = params.structured_outputs
        if so is None or tokenizer is None:
            return
        cls = get_reasoning_parser(self.reasoning_parser or "")
        tail = prompt_tail or ""
        if cls.end_token in tail and tail.rfind(cls.end_token) > tail.rfind(cls.start_token):
            return
        end_ids = list(tokenizer.encode(cls.end_token, add_special_tokens=False))
        params.structured_outputs = dataclasses.replace(so, reasoning_end_token_ids=end_ids)


def _prompt_tail(prompt: Any, tokenizer: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt[-200:]
    if tokenizer is None or not prompt:
        return None
    return tokenizer.decode(list(prompt)[-_PROMPT_TAIL_TOKENS:])


def add_agent_cli_args(parser: Any) -> None:
    """Add vLLM's tool-calling and reasoning flags to the `serve` parser."""
    from tokenmill.entrypoints.openai.reasoning.parsers import reasoning_parser_names
    from tokenmill.entrypoints.openai.tool_parsers.registry import tool_parser_names

    g = parser.add_argument_group("tool calling and reasoning")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Allow tool_choice "auto": the model decides, --tool-call-parser reads its calls.')
    g.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                   help="How the model writes tool calls (turns its text into tool_calls).")
    g.add_argument("--reasoning-parser", default=None, choices=reasoning_parser_names(),
                   help="Split thinking text (<think>...</think>) into message.reasoning_content.")


def agent_kwargs(args: Any) -> dict[str, Any]:
    """The chat handler's keyword arguments from parsed CLI args (absent flags -> defaults)."""
    return {"enable_auto_tool_choice": bool(getattr(args, "enable_auto_tool_choice", False)),
            "tool_call_parser": getattr(args, "tool_call_parser", None),
            "reasoning_parser": getattr(args, "reasoning_parser", None)}
