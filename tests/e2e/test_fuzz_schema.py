"""Property: no request built from the server's own OpenAPI schema gets a 5xx (schemathesis + hypothesis).

Runs against the session's real `prod_server` (conftest.py: --max-model-len
256, --max-num-seqs 64 so n <= 64, --max-logprobs 20, an API key), so the
handlers, validation and engine under test are the production ones.
Examples are derandomized with a fixed budget per operation. To fit the
suite's CPU budget, generation length alone is bounded: `max_tokens` /
`max_completion_tokens` / `max_output_tokens` / Ollama's `num_predict` above 4 or absent become 4
(an absent max_tokens is tested in test_production.py); every other field is
fuzzed as generated, wrong types included.
"""

from __future__ import annotations

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
