"""Chat completions for harmony models (gpt-oss): the prompt side and the output side.

`HarmonyChat.prepare` replaces the chat template for these models: it
renders the messages with openai-harmony, stops the turn on `<|return|>` and
`<|call|>`, and attaches a `HarmonyChatOutputParser` that reads the output
token ids (harmony's markers are special tokens, so the text alone is not
enough). Structured output (`response_format`) applies to the final answer
only: the grammar starts after `<|channel|>final<|message|>`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tokenmill.entrypoints.openai.harmony.encoding import load_encoding
from tokenmill.entrypoints.openai.harmony.parse import HarmonyStreamer, parse_output
from tokenmill.entrypoints.openai.harmony.render import render_chat, stop_token_ids
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# vLLM's parser names for the harmony format.
TOOL_CALL_PARSER = "openai"
REASONING_PARSER = "openai_gptoss"
FINAL_ANSWER_OPENER = "<|channel|>final<|message|>"


class HarmonyChatOutputParser:
    """The response side of one harmony request (the `ChatOutputParser` interface, on token ids)."""

    reads_token_ids = True  # serving_chat passes `CompletionOutput.token_ids`, not `.text`

    def message(self, token_ids: list[int], finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(message fields, finish_reason): `content`, `reasoning_content`, `tool_calls` when calls were made."""
        out = parse_output(token_ids)
        fields: dict[str, Any] = {"content": out.content, "reasoning_content": out.reasoning}
        if out.tool_calls:
            fields["tool_calls"] = out.tool_calls
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return fields, finish_reason

    def streamer(self) -> HarmonyStreamer:
        return HarmonyStreamer()


def _tools_for(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools to render: none for tool_choice "none".

    Raises:
        ValueError: tool_choice "required" or a named function (gpt-oss
            decides itself whether to call; nothing forces its channel).
    """
    if tool_choice in (None, "auto"):
        return tools
    if tool_choice == "none":
        return None
    raise ValueError("For harmony models (gpt-oss) tool_choice may be \"auto\" or \"none\"; \"required\" and "
                     "named functions are not supported, the model decides itself when to call a tool.")


class HarmonyChat:
    """Server-side harmony settings; checks that openai-harmony and the vocabulary load (at start-up)."""

    def __init__(self) -> None:
        load_encoding()
        logger.info("harmony chat format (gpt-oss): tool calls as --tool-call-parser %s, reasoning as "
                    "--reasoning-parser %s", TOOL_CALL_PARSER, REASONING_PARSER)

    def prepare(self, req: Any, messages: list[dict[str, Any]], params: SamplingParams) -> list[int]:
        """Render the prompt ids, adjust `params` in place, set `req._output_parser`.

        Raises:
            ValueError: bad messages, reasoning_effort or tool_choice; a chat_template,
                continue_final_message or add_generation_prompt=false (harmony has no use for them).
        """
        if getattr(req, "chat_template", None):
            raise ValueError("This model speaks the harmony format (gpt-oss), rendered by openai-harmony: it takes "
                             "no chat_template; send the request without it.")
        if getattr(req, "continue_final_message", False) or getattr(req, "add_generation_prompt", True) is False:
            raise ValueError("continue_final_message / add_generation_prompt=false are not supported for harmony "
                             "models (gpt-oss): the prompt always ends by opening the assistant's turn.")
        tools = _tools_for(getattr(req, "tools", None), getattr(req, "tool_choice", None))
        effort = getattr(req, "reasoning_effort", None) or (getattr(req, "chat_template_kwargs", None) or {}).get(
            "reasoning_effort")
        prompt = render_chat(messages, tools, effort)
        params.stop_token_ids = sorted(set(params.stop_token_ids or []) | set(stop_token_ids()))
        params.all_stop_token_ids.update(params.stop_token_ids)
        if params.structured_outputs is not None:  # the constraint starts with the final answer
            opener = load_encoding().encode(FINAL_ANSWER_OPENER, allowed_special="all")
            params.structured_outputs = dataclasses.replace(params.structured_outputs,
                                                            reasoning_end_token_ids=list(opener))
        req._output_parser = HarmonyChatOutputParser()
        return prompt


def uses_harmony(hf_config: Any, tool_call_parser: str | None, reasoning_parser: str | None) -> bool:
    """Harmony for gpt-oss models, or when a harmony parser name was given explicitly."""
    from tokenmill.entrypoints.openai.harmony.encoding import is_harmony_model

    return is_harmony_model(hf_config) or TOOL_CALL_PARSER == tool_call_parser \
        or REASONING_PARSER == reasoning_parser
