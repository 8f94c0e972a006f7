"""--disable-fastapi-docs closes the schema routes, which are otherwise open (docs/server.md, security model)."""

from __future__ import annotations

import asyncio


def test_disable_fastapi_docs_removes_the_schema_routes(fake_engine):
    from fake_engine import asgi_call

    from tokenmill.entrypoints.openai.api_server import build_app
    from tokenmill.entrypoints.openai.http_options import HTTPOptions

    for disabled, want in ((False, 200), (True, 404)):
        app = build_app(fake_engine, ["fake-model"], http_options=HTTPOptions(docs=not disabled))
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert asyncio.run(asgi_call(app, "GET", path))[0] == want, (disabled, path)
