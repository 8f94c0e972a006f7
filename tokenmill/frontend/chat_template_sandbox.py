"""Chat templates rendered in Jinja's immutable sandbox, with bounded work and output.

Every chat template (the model's, `--chat-template`, and a request's when the
operator allows them) renders here. Jinja's `ImmutableSandboxedEnvironment`
already refuses file access (no loader, so no `include`/`import`/`extends`),
imports, dunder attributes and mutation of the inputs; on top of it this
module bounds what one render may cost:

    work    <= MAX_WORK units: a loop iteration or a call costs ITERATION_COST (a macro call MACRO_CALL_COST),
               building a string or list costs its length (`+`, `~`, `*`, `%`,
               filters, method calls)
    a value <= MAX_VALUE_CHARS characters (or list items); padding widths,
               repeat counts and format widths above it are refused up front
    output  <= MAX_OUTPUT_CHARS characters
    range() <= 100000 items (Jinja's own sandbox limit)

Any failure while rendering (a template error, a budget exceeded, a Python
error inside the template such as OverflowError or RecursionError) raises
`ChatTemplateError`, a `ValueError` (HTTP 400): a template is code supplied
with the model or the request, so its failures are input errors.

`sanitize_control_tokens=True` renders client-supplied strings (messages,
tools, documents, template variables) with their control tokens escaped, so
`<|im_start|>system` typed by a user encodes as plain text; only the control
tokens the template itself writes become special tokens. It reuses
transformers' marking scheme (`mark_control_tokens` / `encode_marked_chat`).
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_WORK = 100_000_000  # ~1 s of CPU at the most (2M loop iterations, or 100M chars copied)
ITERATION_COST = 50
# A macro call runs a Python closure with its own context (~7 us, 100x a loop step): charged as such, so that
# recursive macro fan-out stays near MAX_WORK's ~1 s (it took ~14 s at ITERATION_COST).
MACRO_CALL_COST = 1000
MAX_VALUE_CHARS = 16 * 2**20  # one string/list: 4x the default request body cap
MAX_OUTPUT_CHARS = 16 * 2**20

# Names the renderer passes itself: a request's chat_template_kwargs may not
# set them (entrypoints/openai/chat_template_guard.py refuses them).
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

_COUNT = "__tm_count"  # template-global: wraps every for-loop's iterable
_CONCAT = "__tm_concat"  # template-global: replaces `~` concatenation
_FORMAT_WIDTH = re.compile(r"\d{7,}")  # str.format: a width/precision of 1e6+ chars
_PRINTF_WIDTH = re.compile(r"%[-+ #0]*(?:\*|\d{7,})|%[-+ #0]*\d*\.(?:\*|\d{7,})")  # `%`: the same, or from the args


class ChatTemplateError(ValueError):
    """A chat template failed to render or exceeded its budget (HTTP 400)."""


class _Budget:
    __slots__ = ("left", "output")

    def __init__(self) -> None:
        self.left = MAX_WORK
        self.output = 0

    def charge(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise ChatTemplateError(f"The chat template did too much work (more than {MAX_WORK} units: loop "
                                    "iterations and string building); simplify it.")


_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("tokenmill_template_budget")


def _charge(units: int) -> None:
    budget = _budget.get(None)
    if budget is not None:
        budget.charge(units)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_size(value: Any) -> Any:
    n = _size(value)
    if n > MAX_VALUE_CHARS:
        raise ChatTemplateError(f"The chat template built a value of {n} characters or items (limit "
                                f"{MAX_VALUE_CHARS}).")
    _charge(n)
    return value


def _check_amplifiers(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse padding widths / repeat counts / format widths that would build a huge value before we see it."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_VALUE_CHARS:
            raise ChatTemplateError(f"The chat template passed {a} to a function; numbers above {MAX_VALUE_CHARS} "
                                    "are refused (they would build a huge value).")


def _count(iterable: Any) -> Any:
    for item in iterable:
        _charge(ITERATION_COST)
        yield item


def _concat(*parts: Any) -> str:
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    if sum(len(t) for t in texts) > MAX_VALUE_CHARS:
        raise ChatTemplateError(f"The chat template built a string longer than {MAX_VALUE_CHARS} characters.")
    return _check_size("".join(texts))


def _estimate_binop(op: str, left: Any, right: Any) -> int:
    """Size of `left op right` before computing it (0 when it cannot be large)."""
    if op == "+":
        return _size(left) + _size(right)
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) and isinstance(n, int):
                return _size(seq) * max(n, 0)
        return 0
    if op == "%" and isinstance(left, str):
        if _PRINTF_WIDTH.search(left):
            raise ChatTemplateError("The chat template formats with a width or precision that is too large.")
        return len(left) + sum(_size(x) for x in (right if isinstance(right, tuple) else (right,)))
    if op == "**" and isinstance(left, int) and isinstance(right, int):
        return abs(left).bit_length() * max(right, 0) // 4  # decimal digits, roughly
    return 0


# str methods and filters whose int arguments are output widths (`'x'.ljust(10**9)`, `x|center(10**9)`).
_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_PADDING_FILTERS = frozenset({"center", "indent", "wordwrap"})


def _estimate_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Size of a str method's result when it can be far above its inputs' sizes."""
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format / format_map
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return 0
    if name in _PADDING_METHODS:
        _check_amplifiers(args, kwargs)
    if name in ("format", "format_map") and _FORMAT_WIDTH.search(owner):
        raise ChatTemplateError("The chat template formats with a width or precision that is too large.")
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = owner.count(args[0]) if args[0] else len(owner) + 1
        return len(owner) + hits * max(len(args[1]) - len(args[0]), 0)
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        return len(owner) * len(args[0]) + sum(_size(x) for x in args[0])
    return 0


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the budget above (loops, calls, operators, filters, output)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(_COUNT, "load"), [loop.iter], [], None, None).set_lineno(loop.lineno)
        for concat in list(tree.find_all(nodes.Concat)):
            call = nodes.Call(nodes.Name(_CONCAT, "load"), concat.nodes, [], None, None).set_lineno(concat.lineno)
            concat.nodes = [call]  # a one-part Concat of our checked join
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if _estimate_binop(operator, left, right) > MAX_VALUE_CHARS:
            raise ChatTemplateError(f"The chat template's `{operator}` would build a value above "
                                    f"{MAX_VALUE_CHARS} characters.")
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's signature
        _charge(MACRO_CALL_COST if isinstance(__obj, jinja2.runtime.Macro) else ITERATION_COST)
        if __obj is not _count and __obj is not _concat:
            if _estimate_call(__obj, args, kwargs) > MAX_VALUE_CHARS:
                raise ChatTemplateError(f"The chat template's call would build a value above {MAX_VALUE_CHARS} "
                                        "characters.")
        result = super().call(__context, __obj, *args, **kwargs)
        return result if __obj is _count else _check_size(result)


def _bounded_filter(name: str, fn: Any) -> Any:
    """`fn` charging the budget, refusing huge padding widths / format widths first, and checking its result."""
    first = 2 if getattr(fn, "jinja_pass_arg", None) is not None else 1  # pass_context & co. get an extra first arg

    @functools.wraps(fn)  # keeps `jinja_pass_arg`
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _charge(ITERATION_COST)
        if name in _PADDING_FILTERS:
            _check_amplifiers(args[first:], kwargs)
        elif name == "format" and len(args) >= first and isinstance(args[first - 1], str) \
                and _PRINTF_WIDTH.search(args[first - 1]):
            raise ChatTemplateError("The chat template formats with a width or precision that is too large.")
        elif name in ("replace", "join") and len(args) >= first:
            value, rest = args[first - 1], args[first:]
            size = (_estimate_call(str(value).replace, rest, {}) if name == "replace" and isinstance(value, str)
                    else _estimate_call(str(rest[0] if rest else kwargs.get("d", "")).join, (list(value),), {})
                    if name == "join" and isinstance(value, (list, tuple)) else 0)
            if size > MAX_VALUE_CHARS:
                raise ChatTemplateError(f"The chat template's `{name}` filter would build a value above "
                                        f"{MAX_VALUE_CHARS} characters.")
        return _check_size(fn(*args, **kwargs))

    return wrapper


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"The chat template refused these messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    if isinstance(indent, int) and indent > 64:
        raise ChatTemplateError("tojson indent above 64 is refused.")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore names (no way to reach Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's Namespace signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateError(f"namespace attributes may not start with an underscore: {name!r}.")


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile template text in the bounded sandbox (cached by text).

    Raises:
        ChatTemplateError: a syntax error (HTTP 400).
    """
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["tojson"] = _bounded_filter("tojson", _tojson)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=lambda *a, **k: dict(*a, **k))
    env.globals[_COUNT] = _count
    env.globals[_CONCAT] = _concat
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"The chat template is not valid Jinja: {e}") from e
    except RecursionError as e:
        raise ChatTemplateError("The chat template is nested too deeply to compile.") from e


def render(source: str, variables: dict[str, Any]) -> str:
    """Render `source` with `variables` under the budget.

    Returns:
        The rendered text (at most MAX_OUTPUT_CHARS characters).

    Raises:
        ChatTemplateError: the template is invalid, raised an error, or went over a bound (HTTP 400).
    """
    template = compile_template(source)
    budget = _Budget()
    token = _budget.set(budget)
    parts: list[str] = []
    try:
        for chunk in template.generate(**variables):
            budget.output += len(chunk)
            if budget.output > MAX_OUTPUT_CHARS:
                raise ChatTemplateError(f"The chat template's output is longer than {MAX_OUTPUT_CHARS} characters.")
            parts.append(chunk)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"The chat template could not render these messages: {e}") from e
    except RecursionError as e:
        raise ChatTemplateError("The chat template recursed too deeply.") from e
    except Exception as e:  # noqa: BLE001 - anything a template does wrong is an input error
        raise ChatTemplateError(f"The chat template could not render these messages: {type(e).__name__}: {e}") from e
    finally:
        _budget.reset(token)
    return "".join(parts)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat(tokenizer: Any, template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                documents: list[dict[str, Any]] | None = None, control_tokens_re: re.Pattern | None = None,
                **template_vars: Any) -> str:
    """Render a conversation to prompt text (transformers' `apply_chat_template` variables and rules).

    Args:
        tokenizer: gives the special-token variables (`bos_token`, `eos_token`, ...).
        template: Jinja text (never a path).
        messages: OpenAI-style dicts; None-valued keys are dropped as transformers does.
        continue_final_message: end the prompt inside the last message (no end-of-turn).
        control_tokens_re: when set, client strings are marked with it (see `sanitize_control_tokens`).
        **template_vars: extra variables (`chat_template_kwargs`; the server refuses RESERVED_TEMPLATE_VARS there).

    Raises:
        ChatTemplateError: see `render`; or continue_final_message with nothing to continue.
    """
    msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
    if control_tokens_re is not None:
        from transformers.utils.chat_template_utils import mark_control_tokens

        msgs, tools, documents, template_vars = (mark_control_tokens(x, control_tokens_re)
                                                 for x in (msgs, tools, documents, template_vars))
    final = None
    if continue_final_message:
        if not msgs or not isinstance(msgs[-1].get("content"), str):
            raise ChatTemplateError("continue_final_message needs a last message with text content.")
        final = msgs[-1]["content"]
        msgs[-1] = {**msgs[-1], "content": final + _CONTINUE_TAG}
    special = dict(getattr(tokenizer, "special_tokens_map", None) or {})
    special = {k: v for k, v in special.items() if isinstance(v, str)}
    text = render(template, {**special, **template_vars, "messages": msgs, "tools": tools, "documents": documents,
                             "add_generation_prompt": add_generation_prompt})
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if tag not in text or final.strip() not in text:
            raise ChatTemplateError("continue_final_message: the chat template dropped (part of) the final message, "
                                    "so it cannot be continued.")
        loc = text.rindex(tag)
        text = text[:loc] if text[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:loc].rstrip()
    return text


def chat_template_text(tokenizer: Any, template: str | None, tools: Any = None) -> str:
    """The Jinja text to render: `template` (text, never a path), else the tokenizer's own.

    A tokenizer with several named templates picks by name (`template` may be
    one of the names), else "tool_use" when tools are given, else "default".

    Raises:
        ValueError: no template is given and the tokenizer has none.
    """
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        if template is not None and template in own:
            return own[template]
        if template is None:
            template = own.get("tool_use") if tools and "tool_use" in own else own.get("default")
    elif template is None:
        template = own
    if not template:
        raise ValueError("This tokenizer has no chat template, so chat messages cannot be turned into a prompt; "
                         "pass one with --chat-template (a file or Jinja text) or use plain completions.")
    return template


def control_tokens_pattern(tokenizer: Any, template: str) -> re.Pattern:
    """The control tokens client text must not produce: special added tokens, and added tokens the template writes.

    Longer tokens match first. Source: transformers' `sanitize_control_tokens` rule.
    """
    texts = [template]
    try:  # string literals too (a template may write '<|im_start|>' inside an expression)
        ast = compile_template(template).environment.parse(template)
        texts += [n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)]
    except jinja2.TemplateError:
        pass
    literal = "\0".join(texts)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = [t.content for t in decoder.values()
              if t.special or (t.content in literal and not t.content.isspace())]
    tokens.sort(key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens)) or "(?!)")


def encode_chat(tokenizer: Any, text: str, sanitized: bool) -> list[int]:
    """Token ids of a rendered chat (no BOS added: the template wrote it); `sanitized`: marked client text as text."""
    if sanitized:
        from transformers.utils.chat_template_utils import encode_marked_chat

        try:
            return list(encode_marked_chat(tokenizer, text))
        except ValueError as e:
            raise ChatTemplateError(f"Could not escape the control tokens in these messages: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt_ids(tokenizer: Any, template: str | None, messages: list[dict[str, Any]], *,
                    add_generation_prompt: bool = True, sanitize_control_tokens: bool = False,
                    **template_vars: Any) -> list[int]:
    """Prompt token ids of a conversation: `template` is Jinja text (never opened as a file) or None (the model's).

    Args:
        sanitize_control_tokens: encode control tokens inside client strings as plain text.
        **template_vars: `tools`, `documents`, `continue_final_message` and `chat_template_kwargs`.

    Raises:
        ValueError / ChatTemplateError: no tokenizer or template, or the template failed (HTTP 400).
    """
    if tokenizer is None:
        raise ValueError("Chat needs a tokenizer; the engine was started with skip_tokenizer_init.")
    text = chat_template_text(tokenizer, template, template_vars.get("tools"))
    pattern = control_tokens_pattern(tokenizer, text) if sanitize_control_tokens else None
    rendered = render_chat(tokenizer, text, messages, add_generation_prompt=add_generation_prompt,
                           control_tokens_re=pattern, **template_vars)
    return encode_chat(tokenizer, rendered, sanitized=pattern is not None)
