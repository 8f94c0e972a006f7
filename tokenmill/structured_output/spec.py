"""StructuredOutputSpec: what shape one request's output must take, parsed and checked.

A request asks for structured output through the typed field
`SamplingParams.structured_outputs` (`StructuredOutputsParams`, vLLM's
field names), with exactly one of:

    json=<JSON schema dict or JSON text>
    json_object=True                           any JSON object
    regex="<regular expression>"
    choice=["yes", "no", ...]                  exactly one of these strings
    grammar="<EBNF (GBNF, 'root ::= ...') or Lark text>"

The params stay plain data (msgpack-safe) on their way to the engine core;
this module turns them into a `StructuredOutputSpec` and checks it without a
tokenizer, so a bad schema is a `ValueError` (HTTP 400) when the request is
built, never an engine-core failure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.sampling_params import StructuredOutputsParams

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """One request's output constraint.

    Attributes:
        kind: one of KINDS.
        value: the kind's text: the JSON schema (canonical JSON text), the
            regex, the EBNF/Lark grammar, or the choices as a JSON list; ""
            for json_object.
    """

    kind: str
    value: str

    @property
    def key(self) -> str:
        """Cache key of the compiled grammar (two equal specs share one)."""
        return f"{self.kind}:{self.value}"

    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.value)


def get_spec(params: StructuredOutputsParams | None) -> StructuredOutputSpec | None:
    """The spec that `SamplingParams.structured_outputs` asks for, or None when it is None.

    Raises:
        ValueError: the params set no constraint or several, or a value has the wrong type.
    """
    if params is None:
        return None
    raw = {k: getattr(params, k) for k in KINDS}
    present = [k for k in KINDS if raw[k] not in (None, False)]
    if len(present) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                         f"{present or 'none'}.")
    kind = present[0]
    value = raw[kind]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"The JSON schema is not valid JSON: {e}.") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"A JSON schema must be an object, got {type(value).__name__}.")
        return StructuredOutputSpec("json", json.dumps(value, ensure_ascii=False))
    if kind == "json_object":
        return StructuredOutputSpec("json_object", "")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")
        return StructuredOutputSpec("choice", json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string.")
    return StructuredOutputSpec(kind, value)


def validate_structured_outputs(params: StructuredOutputsParams | None) -> StructuredOutputSpec | None:
    """Parse and check the request's structured-output spec (the front end's request-time check).

    Returns:
        The spec, or None when the request has none.

    Raises:
        ValueError: the spec is malformed or its schema/regex/grammar is invalid.
    """
    spec = get_spec(params)
    if spec is not None:
        validate_spec(spec)
    return spec


def choice_ebnf(choices: list[str]) -> str:
    """EBNF whose only sentences are the given strings: `root ::= "a" | "b"`.

    JSON string escapes are valid EBNF string escapes in xgrammar's dialect
    (quotes, backslashes, control characters); other characters stay literal.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def validate_spec(spec: StructuredOutputSpec) -> None:
    """Check the spec builds a grammar (no tokenizer needed; milliseconds).

    Raises:
        ValueError: the JSON schema is not a valid schema, or the regex /
            grammar does not parse; the sentence says which and why.
    """
    xgr = import_xgrammar()
    try:
        if spec.kind == "json":
            schema = json.loads(spec.value)
            _check_json_schema(schema)
            xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(spec.choices()))
        elif spec.kind == "grammar":
            _grammar_from_text(xgr, spec.value)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own errors for bad input
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}[spec.kind]
        raise ValueError(f"The {what} in the request cannot be used for structured output: "
                         f"{_clean_error(e)}.") from None


def import_xgrammar() -> Any:
    """The xgrammar module.

    Raises:
        ValueError: it is not installed (the request cannot be served; HTTP 400 with the fix).
    """
    try:
        import xgrammar
    except ImportError:
        raise ValueError("Structured output needs the xgrammar package, which is not installed on this server; "
                         "install it with: pip install -e '.[structured]' in the tokenmill checkout.") from None
    return xgrammar


def _grammar_from_text(xgr: Any, text: str) -> Any:
    """GBNF-style EBNF when the text has `::=`, else Lark (vLLM accepts both)."""
    if "::=" in text:
        return xgr.Grammar.from_ebnf(text)
    return xgr.Grammar.from_lark(text)


def _clean_error(e: BaseException) -> str:
    """xgrammar's message without its `[hh:mm:ss] /path/file.cc:123: ` prefix."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", lines[0]).rstrip(".")


def _check_json_schema(schema: Any) -> None:
    """A meta-schema check (Draft 2020-12) when `jsonschema` is installed."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"The JSON schema is invalid: {e.message}.") from None
