"""OpenAI `response_format` and vLLM `structured_outputs` request fields -> `StructuredOutputsParams`.

    response_format {"type": "text"}                          -> nothing
    response_format {"type": "json_object"}                   -> {"json_object": True}
    response_format {"type": "json_schema",
                     "json_schema": {"name": ..., "schema": S}} -> {"json": S}
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM)
    guided_json / guided_regex / guided_choice / guided_grammar (vLLM's older names)
"""

from __future__ import annotations

from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.spec import KINDS, validate_structured_outputs

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_from_fields(response_format: Any = None, structured_outputs: Any = None,
                                   guided: dict[str, Any] | None = None) -> StructuredOutputsParams | None:
    """The `SamplingParams.structured_outputs` a request asks for, or None.

    Args:
        response_format: OpenAI's field (dict or pydantic model dump).
        structured_outputs: vLLM's field.
        guided: vLLM's older `guided_*` fields that were set.

    Raises:
        ValueError: malformed `response_format`, more than one way of asking,
            or an invalid schema / regex / grammar.
    """
    asked: list[dict[str, Any]] = []
    if response_format is not None:
        rf = _response_format_spec(response_format)
        if rf is not None:
            asked.append(rf)
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}.")
        so = {k: v for k, v in structured_outputs.items() if k in KINDS and v not in (None, False)}
        if so:
            asked.append(so)
    for name, value in (guided or {}).items():
        if value is not None and name in _GUIDED:
            asked.append({_GUIDED[name]: value})
    if not asked:
        return None
    if len(asked) > 1:
        raise ValueError("Ask for structured output one way only: response_format, structured_outputs or a "
                         "guided_* field.")
    params = StructuredOutputsParams(**asked[0])
    validate_structured_outputs(params)
    return params


def _response_format_spec(rf: Any) -> dict[str, Any] | None:
    if hasattr(rf, "model_dump"):
        rf = rf.model_dump()
    if not isinstance(rf, dict):
        raise ValueError('response_format must be an object such as {"type": "json_object"}.')  # noqa: TRY004 - HTTP 400
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError('response_format of type "json_schema" needs a "json_schema" object with a "schema".')
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows omitting it: any object
        return {"json": schema}
    raise ValueError(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}.')
