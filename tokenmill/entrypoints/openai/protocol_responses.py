"""POST /v1/responses: the request body and its translation to a chat request.

The Responses API is served on top of chat completions: `input` items
become chat messages, `tools` / `tool_choice` / `text.format` /
`reasoning.effort` become their chat spellings, and the chat handler's
template (or harmony) and output parsers do the rest. Input items:

    "text"                                          one user message
    {"type": "message", "role", "content"}          content: text, or input_text / output_text parts
    {"role", "content"} (no type)                   the same (OpenAI's easy input message)
    {"type": "function_call", "call_id", "name", "arguments"}   an assistant tool call
    {"type": "function_call_output", "call_id", "output"}       its result (a `tool` message)
    {"type": "reasoning", "content": [{"type": "reasoning_text", "text"}]}
                                                    reasoning of the next assistant turn

Anything else (images, files, item references, built-in tools) is a 400
that names the item.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from tokenmill.entrypoints.openai.protocol import OpenAIModel, _finite

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses body (the fields tokenmill implements; others are ignored by pydantic)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "auto"
    parallel_tool_calls: bool | None = True
    reasoning: dict[str, Any] | None = None  # {"effort": "low" | "medium" | "high"}
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = _finite()
    top_p: float | None = _finite()
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | "json_object", ...}}
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool | None = False
    # vLLM extensions
    top_k: int | None = None
    seed: int | None = None
    request_id: str | None = None


def _text_of(content: Any, where: str) -> str:
    """Text of an item's content: a string, or a list of text parts joined with newlines.

    Raises:
        ValueError: a part that is not text (images, files, audio).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of content parts.")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}.content[{j}]: only text parts (input_text, output_text) are supported, "
                             f"got {kind!r}.")
        texts.append(part["text"])
    return "\n".join(texts)


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def input_to_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for a Responses `input`.

    Consecutive function_call items (and a reasoning item before them)
    become one assistant message with `tool_calls`, as chat templates expect.

    Raises:
        ValueError: an unknown item type or role, a non-text part, a
            function_call without call_id/name, or an empty input.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise ValueError("input must be a non-empty string or list of items.")
    out: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item waiting for its assistant turn
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object.")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise ValueError(f"{where}: unknown role {role!r}; use one of {', '.join(MESSAGE_ROLES)}.")
            msg: dict[str, Any] = {"role": role, "content": _text_of(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            if not _nonempty_str(item.get("call_id")) or not _nonempty_str(item.get("name")):
                raise ValueError(f"{where}: a function_call item needs `call_id` and `name` strings.")
            args = item.get("arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"],
                                 "arguments": args if isinstance(args, str) else json.dumps(args or {})}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last and reasoning is None:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            if not _nonempty_str(item.get("call_id")):
                raise ValueError(f"{where}: a function_call_output item needs the `call_id` (a string) of its call.")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = (reasoning or "") + _text_of(parts, where)
        else:
            raise ValueError(f"{where}: unknown input item type {kind!r}; supported: {', '.join(INPUT_ITEM_TYPES)}.")
    if not out:
        raise ValueError("input holds no message, function_call or function_call_output item.")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) -> chat tools (`{"type": "function", "function": {...}}`).

    Raises:
        ValueError: a tool of another type (web_search, file_search, ...) or without a name.
    """
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ValueError(f"tools[{i}]: only function tools are supported, got type {kind!r}.")
        if not _nonempty_str(t.get("name")):
            raise ValueError(f"tools[{i}]: a function tool needs a `name`.")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise ValueError(f"tools[{i}].description must be a string.")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        if t.get("strict") is not None:
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses tool_choice -> chat tool_choice.

    Raises:
        ValueError: a choice other than auto / none / required / a named function.
    """
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and _nonempty_str(tool_choice.get("name")):
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    raise ValueError(f"tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"name\": "
                     f"...}}, got {tool_choice!r}.")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """Responses `text.format` -> chat `response_format` (None for plain text).

    Raises:
        ValueError: an unknown format type, or json_schema without a schema.
    """
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ValueError("text.format must be an object such as {\"type\": \"json_schema\", \"name\": ..., "
                         "\"schema\": {...}}.")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ValueError("text.format of type json_schema needs a `schema` object.")
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise ValueError(f"text.format.type must be text, json_schema or json_object, got {fmt.get('type')!r}.")


def reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    """`reasoning.effort` (low / medium / high), or None.

    Raises:
        ValueError: another value.
    """
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    if not isinstance(effort, str) or effort not in ("low", "medium", "high"):
        raise ValueError(f"reasoning.effort must be low, medium or high, got {effort!r}.")
    return effort


def to_chat_body(req: ResponsesRequest, history: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    """The chat completions body that serves `req` after the stored `history` messages.

    Raises:
        ValueError: any of the translations above fails, or `background` is set.
    """
    if req.background:
        raise ValueError("background responses are not supported by this server; send the request without "
                         "`background`.")
    messages = list(history) + input_to_messages(req.input)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": chat_tools(req.tools),
        "parallel_tool_calls": req.parallel_tool_calls, "reasoning_effort": reasoning_effort(req.reasoning),
        "response_format": chat_response_format(req.text), "user": req.user, "top_k": req.top_k,
        "seed": req.seed, "request_id": request_id,
        # A streamed response needs the outputs as they grow (DELTA), not only the final one.
        "stream": bool(req.stream),
    }
    if body["tools"]:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    return {k: v for k, v in body.items() if v is not None}
