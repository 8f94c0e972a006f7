"""Chat-template rendering: a conversation -> prompt text (front end only).

Tokenizers are loaded by `model_loader/tokenizer.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.frontend.chat_template_sandbox import chat_template_text, render_chat


def resolve_chat_template(template: str | None) -> str | None:
    """A chat template given as a file path or as inline Jinja text -> the text.

    Raises:
        ValueError: `template` looks like a path (no Jinja braces) but no file is there.
    """
    if template is None:
        return None
    if "{" in template or "\n" in template:
        return template
    p = Path(template).expanduser()
    if p.is_file():
        return p.read_text()
    raise ValueError(f"Chat template {template!r} is neither a readable file nor Jinja text.")


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None,
                        add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render a conversation to prompt text with the tokenizer's (or the given) chat template.

    Args:
        tokenizer: a transformers tokenizer.
        messages: OpenAI-style `[{"role": ..., "content": ...}, ...]`.
        chat_template: a file path or Jinja text that replaces the tokenizer's template
            (an operator's value: the server renders request templates with
            `chat_template_sandbox.chat_prompt_ids`, which never opens a file).
        add_generation_prompt: end with the assistant turn's opening.
        **kwargs: extra template variables (`chat_template_kwargs`, `tools`, ...).

    Returns:
        The prompt text. Tokenize it with `add_special_tokens=False`: the
        template already wrote any BOS.

    Raises:
        ValueError: no template is given and the tokenizer has none, or the
            template fails to render or exceeds its bounds (`ChatTemplateError`,
            see chat_template_sandbox.py, where every template renders).
    """
    if tokenizer is None:
        raise ValueError("Chat needs a tokenizer; the engine was started with skip_tokenizer_init.")
    template = chat_template_text(tokenizer, resolve_chat_template(chat_template), kwargs.get("tools"))
    return render_chat(tokenizer, template, messages, add_generation_prompt=add_generation_prompt, **kwargs)
