"""Property: no request built from the server's own OpenAPI schema gets a 5xx (schemathesis + hypothesis).

Runs against the session's real `prod_server` (conftest.py: --max-model-len
256, --max-num-seqs 64 so n <= 64, --max-logprobs 20, an API key), so the
handlers, validation and engine under test are the production ones.
Examples are derandomized with a fixed budget per operation. To fit the
suite's CPU budget, generation length alone is bounded: `max_tokens` /
`max_completion_tokens` / `max_output_tokens` / Ollama's `num_predict` above 4 or absent become 4
(an absent max_tokens is tested in test_production.py); every other field is
fuzzed as generated, wrong types included.

A second property sends hand-built nested message structures and Unicode
edge cases (lone surrogates, escaped and as raw bytes) to the chat,
completion, tokenize and Ollama routes, with the same bounds.
"""

from __future__ import annotations

import json
import re

import pytest
from optional_deps import require
from server_harness import API_KEY

schemathesis = require("schemathesis")
hypothesis = require("hypothesis")

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 25
MAX_NEW_TOKENS = 4
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture(scope="module")
def operations(prod_server):
    schema = schemathesis.openapi.from_url(f"{prod_server.base}/openapi.json", headers=AUTH)
    return {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}


def _bound_generation_length(case) -> None:
    """Keep each generation a few tokens long (see module docstring); other fields stay as generated."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        for name in _LENGTH_FIELDS:
            value = body.get(name)
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW_TOKENS):
                body[name] = MAX_NEW_TOKENS
    elif case.path in ("/api/chat", "/api/generate"):
        options = body.get("options")
        if options is None:
            body["options"] = {"num_predict": MAX_NEW_TOKENS}
        elif isinstance(options, dict):
            value = options.get("num_predict")
            if value is None or (isinstance(value, int) and not isinstance(value, bool)
                                 and (value < 0 or value > MAX_NEW_TOKENS)):
                options["num_predict"] = MAX_NEW_TOKENS


def test_the_schema_lists_every_public_route(operations):
    expected = {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /tokenize",
                "POST /detokenize", "GET /health", "GET /version", "POST /api/chat", "POST /api/generate",
                "GET /api/tags", "POST /api/show", "POST /v1/responses", "GET /v1/responses/{response_id}"}
    assert expected <= set(operations)


def _fuzz(name: str, op, base: str, seen: dict[str, int]):
    """A hypothesis test sending MAX_EXAMPLES schema-generated requests to one operation."""

    @hypothesis.settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(case=op.as_strategy())
    def check(case) -> None:
        _bound_generation_length(case)
        response = case.call(base_url=base, headers=AUTH, timeout=120)
        assert response.status_code < 500, (name, case.body, response.text[:500])
        if response.status_code >= 400:
            assert "error" in response.json(), (name, response.text[:500])
        seen[name] = seen.get(name, 0) + 1

    return check


def test_no_request_from_the_schema_gets_a_server_error(operations, prod_server):
    seen: dict[str, int] = {}
    for name, op in sorted(operations.items()):
        _fuzz(name, op, prod_server.base, seen)()
    assert set(seen) == set(operations)  # every operation got requests


# ---------------------------------------------------------------- nested messages and Unicode edge cases

st = hypothesis.strategies
NESTED_EXAMPLES = 40

# Characters that have broken servers: lone surrogates, NUL, BOM, non-characters, bidi and joiners,
# combining marks, astral-plane emoji, and the model's own control-token and Jinja syntax.
_EDGE_TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.lists(st.sampled_from(["\x00", "\ufeff", "\uffff", "\U0010ffff", "\u202e", "\u200d", "\u0301", "😀", "\r\n",
                              "<|im_start|>", "<|im_end|>", "{{ x }}", "{% for %}", "\\", "\"", "a"]),
             max_size=6).map("".join),
)
_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), _EDGE_TEXT)
_JSON = st.recursive(_JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(_EDGE_TEXT, inner, max_size=3)),
                     max_leaves=8)
_ROLE = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), _JSON)
_PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": _EDGE_TEXT}),
                  st.fixed_dictionaries({"type": _JSON}, optional={"text": _JSON, "image_url": _JSON}), _JSON)
_TOOL_CALL = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": _EDGE_TEXT, "arguments": st.one_of(_EDGE_TEXT, _JSON)})}, optional={"id": _JSON}),
    _JSON)
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": _ROLE}, optional={
        "content": st.one_of(_EDGE_TEXT, st.lists(_PART, max_size=3), _JSON),
        "tool_calls": st.one_of(st.lists(_TOOL_CALL, max_size=2), _JSON),
        "tool_call_id": _JSON, "name": _JSON, "reasoning_content": _JSON, "images": _JSON}),
    _JSON)
_MESSAGES = st.one_of(st.lists(_MESSAGE, min_size=1, max_size=4), _JSON)
_BODIES = st.one_of(
    st.fixed_dictionaries({"messages": _MESSAGES}, optional={"chat_template_kwargs": _JSON, "tools": _JSON}).map(
        lambda b: ("/v1/chat/completions", {**b, "max_tokens": 2})),
    st.fixed_dictionaries({"messages": _MESSAGES}).map(lambda b: ("/tokenize", b)),
    st.fixed_dictionaries({"prompt": st.one_of(_EDGE_TEXT, st.lists(_EDGE_TEXT, min_size=1, max_size=2), _JSON)},
                          optional={"stop": _JSON}).map(lambda b: ("/v1/completions", {**b, "max_tokens": 2})),
    st.fixed_dictionaries({"prompt": _JSON}).map(lambda b: ("/tokenize", b)),
    st.fixed_dictionaries({"messages": _MESSAGES}, optional={"format": _JSON, "tools": _JSON}).map(
        lambda b: ("/api/chat", {**b, "stream": False, "options": {"num_predict": 2}})),
    st.fixed_dictionaries({"prompt": _JSON}, optional={"system": _JSON, "raw": _JSON}).map(
        lambda b: ("/api/generate", {**b, "stream": False, "options": {"num_predict": 2}})),
)


def test_nested_messages_and_unicode_edge_cases_get_no_server_error(prod_server):
    """Seeded and bounded (NESTED_EXAMPLES bodies, 2 tokens each); each body is sent as JSON with
    escapes and, when it holds surrogates, also as raw (invalid) UTF-8 bytes."""
    from server_harness import http

    seen: dict[str, int] = {}

    @hypothesis.settings(max_examples=NESTED_EXAMPLES, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(route_body=_BODIES)
    def check(route_body) -> None:
        route, body = route_body
        escaped = json.dumps(body).encode()  # lone surrogates as \\udxxx escapes
        raws = [escaped]
        if re.search(rb"\\ud[89a-f]", escaped):
            raws.append(json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        for raw in raws:
            status, resp, _ = http("POST", prod_server.base + route, raw, AUTH)
            assert status < 500, (route, raw[:300], resp[:500])
            if status >= 400:
                assert "error" in json.loads(resp), (route, resp[:300])
        seen[route] = seen.get(route, 0) + 1

    check()
    assert set(seen) == {"/v1/chat/completions", "/tokenize", "/v1/completions", "/api/chat", "/api/generate"}
