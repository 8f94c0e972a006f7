"""OpenAI chat messages -> a harmony conversation -> prompt token ids (gpt-oss).

The mapping (harmony's roles and channels, as the openai-harmony docs lay them out):

    system (always first)  model identity, reasoning effort, date, channels
    developer              the request's system/developer messages as instructions,
                           and its tools as a `functions` namespace
    user                   user messages
    assistant              reasoning_content -> `analysis` channel;
                           tool_calls -> `commentary to=functions.NAME <|constrain|>json`;
                           content -> `final` channel
    tool                   `functions.NAME` (found through tool_call_id) -> assistant, commentary

Earlier reasoning is dropped: the reasoning of assistant messages up to the
last one with a final answer (content) goes, as gpt-oss was trained; the
reasoning after it (a tool-call loop still running) stays, so the model
keeps its chain of thought between a call and its result.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from tokenmill.entrypoints.openai.harmony.encoding import load_encoding

REASONING_EFFORTS = ("low", "medium", "high")


def _text(content: Any, where: str) -> str:
    """A message's content as text (OpenAI text parts joined with newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or not isinstance(p.get("text"), str):
                raise ValueError(f"{where}: only text content parts are supported for this model.")
            parts.append(p["text"])
        return "\n".join(parts)
    raise ValueError(f"{where}: content must be a string or a list of text parts.")


def _tool_descriptions(tools: list[dict[str, Any]]) -> list[Any]:
    from openai_harmony import ToolDescription

    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}.")
        out.append(ToolDescription.new(fn["name"], fn.get("description") or "", parameters=fn.get("parameters")))
    return out


def build_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                       reasoning_effort: str | None = None, start_date: str | None = None) -> Any:
    """The `openai_harmony.Conversation` for OpenAI chat `messages`.

    Args:
        messages: OpenAI chat messages (dicts; `tool_calls`, `tool_call_id`,
            `reasoning_content` / `reasoning` read where present).
        tools: OpenAI function tools, rendered into the developer message (None / []: none).
        reasoning_effort: "low" | "medium" | "high" (None: medium, harmony's default).
        start_date: the conversation date, YYYY-MM-DD (None: today, UTC).

    Raises:
        ValueError: an unknown role or effort, a non-text part, or a tool
            message whose tool_call_id matches no earlier call.
    """
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
    )

    effort = (reasoning_effort or "medium").lower()
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}.")
    date = start_date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(date)
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [_text(m.get("content"), f"messages[{i}]") for i, m in enumerate(messages)
                    if m.get("role") in ("system", "developer")]
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if tools:
            dev = dev.with_function_tools(_tool_descriptions(tools))
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    call_names: dict[str, str] = {}  # tool_call_id -> function name
    last_final = max((i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("content")),
                     default=-1)
    for i, m in enumerate(messages):
        role, where = m.get("role"), f"messages[{i}]"
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(m.get("content"), where)))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning and i > last_final:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                args = fn.get("arguments")
                args = args if isinstance(args, str) else json.dumps(args or {})
                call_names[call.get("id", "")] = fn.get("name", "")
                out.append(Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
                           .with_recipient(f"functions.{fn.get('name', '')}").with_content_type("<|constrain|>json"))
            content = _text(m.get("content"), where)
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
        elif role == "tool":
            name = m.get("name") or call_names.get(m.get("tool_call_id") or "")
            if not name:
                raise ValueError(f"{where}: tool message with tool_call_id {m.get('tool_call_id')!r} matches no "
                                 "earlier assistant tool call; give the call's id (or the function's `name`).")
            author = Author.new(Role.TOOL, f"functions.{name}")
            out.append(Message.from_author_and_content(author, _text(m.get("content"), where))
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            raise ValueError(f"{where}: unknown role {role!r} (system, developer, user, assistant, tool).")
    return Conversation.from_messages(out)


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                reasoning_effort: str | None = None, start_date: str | None = None) -> list[int]:
    """Prompt token ids for the assistant's next turn (ends with `<|start|>assistant`).

    Same arguments and errors as `build_conversation`.
    """
    from openai_harmony import Role

    conv = build_conversation(messages, tools, reasoning_effort, start_date)
    return list(load_encoding().render_conversation_for_completion(conv, Role.ASSISTANT))


def stop_token_ids() -> list[int]:
    """`<|return|>` and `<|call|>`: where an assistant turn ends (answer done / tool call made)."""
    return list(load_encoding().stop_tokens_for_assistant_actions())
