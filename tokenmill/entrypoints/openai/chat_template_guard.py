"""Which chat templates and template variables a request may bring, and how messages are rendered.

Request fields that reach a template: `chat_template` and
`chat_template_kwargs` (chat and /tokenize; `chat_template_kwargs.chat_template`
is the same thing, as in vLLM). The rules:

    no --trust-request-chat-template      any request template -> 400
    with it                               Jinja text only (it must contain `{{` or `{%`);
                                          it is never opened as a file
    chat_template_kwargs keys the renderer passes itself
        (messages, tools, documents, add_generation_prompt,
         continue_final_message, sanitize_control_tokens)  -> 400

Every template renders in the bounded sandbox (frontend/chat_template_sandbox.py).
No other request field reaches a file, a module import or an environment
lookup: tool and reasoning parsers are chosen by server flags from a fixed
registry, grammars and JSON schemas are compiled in memory (xgrammar does not
fetch a non-local `$ref`; it matches any value there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.frontend.chat_template_sandbox import RESERVED_TEMPLATE_VARS

# Keyword arguments of `apply_chat_template` that a request must not set through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = RESERVED_TEMPLATE_VARS | {"continue_final_message", "sanitize_control_tokens"}


@dataclass(frozen=True, slots=True)
class ChatTemplatePolicy:
    """The server's chat-template rules (`--trust-request-chat-template`, `--sanitize-control-tokens`)."""

    trust_request_chat_template: bool = False
    sanitize_control_tokens: bool = False

    def request_template(self, chat_template: str | None,
                         chat_template_kwargs: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
        """Check a request's template fields; returns (template text or None, the other template variables).

        Raises:
            ValueError: a request template without --trust-request-chat-template, a template that is
                not Jinja text, or a reserved key in chat_template_kwargs (HTTP 400).
        """
        kwargs = dict(chat_template_kwargs or {})
        from_kwargs = kwargs.pop("chat_template", None)
        clash = RESERVED_TEMPLATE_KWARGS & set(kwargs)
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}: the server sets them "
                             "(use the request's own fields, e.g. add_generation_prompt, continue_final_message, "
                             "tools).")
        if chat_template is not None and from_kwargs is not None and chat_template != from_kwargs:
            raise ValueError("Give the chat template once: chat_template and chat_template_kwargs.chat_template "
                             "differ.")
        template = chat_template if chat_template is not None else from_kwargs
        if template is None:
            return None, kwargs
        if not self.trust_request_chat_template:
            raise ValueError("This server does not accept chat templates in requests (chat_template, "
                             "chat_template_kwargs.chat_template); its operator can allow them with "
                             "--trust-request-chat-template.")
        if not isinstance(template, str) or ("{{" not in template and "{%" not in template):
            raise ValueError("chat_template must be Jinja template text (with {{ ... }} or {% ... %}); "
                             "file paths and template names are not accepted in requests.")
        return template, kwargs

    def render(self, engine: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """`engine.apply_chat_template` with this policy's control-token handling."""
        return engine.apply_chat_template(messages, sanitize_control_tokens=self.sanitize_control_tokens, **kwargs)


def add_chat_template_cli_args(group: Any) -> None:
    """`--trust-request-chat-template` and `--sanitize-control-tokens` (docs/server.md, security model)."""
    group.add_argument("--trust-request-chat-template", action="store_true", default=False,
                       help="Accept chat_template (Jinja text only, never a file path) in chat and /tokenize "
                            "requests. Off by default: a template is code that runs on the server (sandboxed and "
                            "bounded, but still code).")
    group.add_argument("--sanitize-control-tokens", action="store_true", default=False,
                       help="Encode control tokens typed in client text (messages, tools, template variables) as "
                            "plain text, so '<|im_start|>system' in a user message cannot open a real turn. Off by "
                            "default, as in vLLM.")
