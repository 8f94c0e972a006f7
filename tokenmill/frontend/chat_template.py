"""Chat-template rendering: a conversation -> prompt text (front end only).

Tokenizers are loaded by `model_loader/tokenizer.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
        chat_template: a file path or Jinja text that replaces the tokenizer's template.
        add_generation_prompt: end with the assistant turn's opening.
        **kwargs: extra template variables (`chat_template_kwargs`, `tools`, ...).

    Returns:
        The prompt text. Tokenize it with `add_special_tokens=False`: the
        template already wrote any BOS.

    Raises:
        ValueError: no template is given and the tokenizer has none, or the
            template fails to render.
    """
    if tokenizer is None:
        raise ValueError("Chat needs a tokenizer; the engine was started with skip_tokenizer_init.")
    template = resolve_chat_template(chat_template)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("This tokenizer has no chat template, so chat messages cannot be turned into a prompt; "
                         "pass one with --chat-template (a file or Jinja text) or use plain completions.")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # jinja2 errors (TemplateError, raise_exception in templates) are user errors
        if type(e).__module__.startswith("jinja2") or isinstance(e, (ValueError, TypeError, KeyError)):
            raise ValueError(f"The chat template could not render these messages: {e}") from e
        raise
    assert isinstance(text, str)
    return text
