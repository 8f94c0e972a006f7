"""The request side of tool calling: `tools` / `tool_choice` -> template input and grammar.

- `tools` reach the model through the chat template (`tools=` template
  variable). A template that ignores them (it renders the same text with
  and without) gets them instead as a system message in the Hermes style
  (`<tools>` JSON signatures, calls written as `<tool_call>{...}</tool_call>`),
  and earlier assistant `tool_calls` / `role: tool` results are written
  into the messages as text in the same style.
- `tool_choice`: "none" (tools are not shown), "auto" (needs the server's
  `--enable-auto-tool-choice --tool-call-parser NAME`; the parser reads the
  output), "required" (a grammar forces a JSON array of one or more calls),
  or `{"type": "function", "function": {"name": X}}` (a grammar forces X's
  arguments object). Forced calls always parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams

FALLBACK_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query. The function signatures are within "
    "<tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a JSON object with "
    'the function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": '
    '<function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(slots=True)
class ToolPlan:
    """How one chat request uses tools.

    mode: "none" | "auto" | "required" | "named".
    named_function: the forced function's name (mode "named").
    tools: the request's tools, validated (OpenAI shape).
    """

    mode: str = "none"
    named_function: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    parallel_tool_calls: bool = True  # False: "required" forces exactly one call

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def validate_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """Check `tools` has OpenAI's shape; returns them.

    Raises:
        ValueError: a tool is not `{"type": "function", "function": {"name": ..., "parameters": {...}}}`.
    """
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                             '...}}.')
        fn = t["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string.")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object.")
        out.append({"type": "function", "function": fn})
    return out


def plan_tools(tools: list[Any] | None, tool_choice: Any, enable_auto_tool_choice: bool,
               tool_call_parser: str | None) -> ToolPlan:
    """Decide the tool mode of a request.

    Raises:
        ValueError: tool_choice is malformed, names an unknown function, needs
            tools that were not given, or is "auto" on a server started
            without `--enable-auto-tool-choice --tool-call-parser`.
    """
    checked = validate_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got '
                             f"{tool_choice!r}.")
        if tool_choice == "none":
            return ToolPlan("none", None, checked)
        if not checked:
            raise ValueError(f'tool_choice "{tool_choice}" needs a non-empty tools list.')
        if tool_choice == "auto" and not (enable_auto_tool_choice and tool_call_parser):
            raise ValueError('"auto" tool choice requires the server to be started with --enable-auto-tool-choice '
                             "and --tool-call-parser NAME.")
        return ToolPlan(tool_choice, None, checked)
    if not isinstance(tool_choice, dict) or not isinstance(tool_choice.get("function"), dict) \
            or not isinstance(tool_choice["function"].get("name"), str):
        raise ValueError('A named tool_choice must be {"type": "function", "function": {"name": "..."}}.')  # noqa: TRY004 - HTTP 400
    name = tool_choice["function"]["name"]
    if name not in {t["function"]["name"] for t in checked}:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools.")
    return ToolPlan("named", name, checked)


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def forced_structured_outputs(plan: ToolPlan) -> dict[str, Any] | None:
    """The structured-output spec that forces the call(s), or None when nothing is forced.

    named: the function's parameters schema (the output is the arguments object).
    required: `[{"name": <one of the tools>, "arguments": {...}}, ...]`, at least one item.
    """
    if plan.mode == "named":
        fn = next(t["function"] for t in plan.tools if t["function"]["name"] == plan.named_function)
        return {"json": _parameters(fn)}
    if plan.mode == "required":
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "arguments": _parameters(t["function"])},
                  "required": ["name", "arguments"]} for t in plan.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items} if len(items) > 1 else items[0]}
        if not plan.parallel_tool_calls:
            schema["maxItems"] = 1
        return {"json": schema}
    return None


def apply_forced_tool_choice(plan: ToolPlan, structured_outputs: StructuredOutputsParams | None,
                             ) -> StructuredOutputsParams | None:
    """`SamplingParams.structured_outputs` with the forcing schema (unchanged when nothing is forced).

    Raises:
        ValueError: the request also asks for its own structured output.
    """
    spec = forced_structured_outputs(plan)
    if spec is None:
        return structured_outputs
    if structured_outputs is not None:
        raise ValueError("A required or named tool_choice cannot be combined with response_format or "
                         "structured_outputs.")
    return StructuredOutputsParams(**spec)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that understands tools: `tool_calls[].function.arguments` as dicts
    (templates write them with `tojson`), everything else unchanged."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_with_dict_args(c) for c in calls]}
        out.append(m)
    return out


def _call_with_dict_args(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    return {**call, "function": fn}


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that ignores tools: the tool signatures in a system message,
    earlier calls and tool results written as Hermes-style text."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    tool_text = FALLBACK_SYSTEM_PROMPT.format(tools=sigs)
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for c in m["tool_calls"]:
                fn = _call_with_dict_args(c)["function"]
                blocks.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")},
                                                           ensure_ascii=False) + "\n</tool_call>")
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + "\n".join(blocks)})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")} | {"content": content})
    if not tools:
        return out
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + tool_text}
    else:
        out.insert(0, {"role": "system", "content": tool_text})
    return out


def render_with_tools(render: Any, messages: list[dict[str, Any]], plan: ToolPlan, **template_kwargs: Any) -> Any:
    """Render the prompt so the model sees the tools.

    Args:
        render: `engine.apply_chat_template`-like callable (messages, **kwargs) -> prompt.
        messages: the request's messages (OpenAI dicts).
        plan: from `plan_tools`.
        template_kwargs: chat_template, add_generation_prompt, chat_template_kwargs...

    A template whose output does not change with `tools` is given the
    fallback system message instead (see module doc).
    """
    if plan.mode == "none" or not plan.tools:
        has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if not has_tool_turns:
            return render(messages, **template_kwargs)
        msgs = template_messages(messages)
        if _template_knows_tool_turns(render, msgs, template_kwargs):
            return render(msgs, **template_kwargs)
        return render(fallback_messages(messages, []), **template_kwargs)
    msgs = template_messages(messages)
    with_tools = render(msgs, tools=plan.tools, **template_kwargs)
    without = render(msgs, **template_kwargs)
    if with_tools != without:
        return with_tools
    return render(fallback_messages(messages, plan.tools), **template_kwargs)


def _template_knows_tool_turns(render: Any, msgs: list[dict[str, Any]], kwargs: dict[str, Any]) -> bool:
    """True when the template writes assistant tool_calls (so tool turns need no fallback)."""
    stripped = [{k: v for k, v in m.items() if k != "tool_calls"} for m in msgs]
    return render(stripped, **kwargs) != render(msgs, **kwargs)
