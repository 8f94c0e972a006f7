"""Request-body checks that need the parsed JSON: invalid Unicode and absurd nesting (HTTP 400, not a 5xx).

JSON may carry lone UTF-16 surrogates (`"\\ud800"`, or the raw bytes ED A0 80,
which Python's decoder lets through as surrogates); Python keeps them in `str`,
and they blow up later in the tokenizer or in UTF-8 encoding. JSON nested
thousands of levels deep makes the parser raise RecursionError. Both are
refused here, before any route parses the body, with the field named:

    {"messages": [{"role": "user", "content": "\\ud800"}]}
        -> 400 "Invalid Unicode in `messages[0].content`: a lone UTF-16 surrogate (U+D800) ..."

A body that is not JSON at all passes through: the route reports it.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64  # far deeper than any request shape (tool schemas included)


class JSONBodyError(ValueError):
    """The body is JSON but unusable; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _surrogate(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(text[e.start]):04X}"
    return None


def _walk(value: Any, path: str, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise JSONBodyError(f"The request body nests deeper than {MAX_JSON_DEPTH} levels (at `{path}`).", path)
    if isinstance(value, str):
        bad = _surrogate(value)
        if bad:
            raise JSONBodyError(f"Invalid Unicode in `{path or 'body'}`: a lone UTF-16 surrogate ({bad}) is not a "
                                "character; send valid UTF-8 text.", path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            bad = _surrogate(key)
            if bad:
                raise JSONBodyError(f"Invalid Unicode in a key of `{path or 'body'}`: a lone UTF-16 surrogate "
                                    f"({bad}).", path or None)
            _walk(item, where, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", depth + 1)


def check_json_body(body: bytes) -> None:
    """Raises JSONBodyError when `body` is JSON holding a lone surrogate or nesting above MAX_JSON_DEPTH."""
    if not body:
        return
    try:
        data = json.loads(body)
    except RecursionError:
        raise JSONBodyError(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.") from None
    except ValueError:  # not JSON (UnicodeDecodeError included): the route's parser answers 400
        return
    _walk(data, "", 0)
