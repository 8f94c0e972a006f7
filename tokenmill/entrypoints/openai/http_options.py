"""The server's HTTP-side flags (vLLM's spellings), resolved once into `HTTPOptions`.

    --root-path                               ASGI root_path (behind a path-prefixing proxy)
    --allowed-origins/-methods/-headers,      CORS (JSON lists); no CORS headers unless one is given
      --allow-credentials
    --ssl-keyfile/-certfile/-ca-certs/-cert-reqs   TLS, handed to uvicorn
    --middleware IMPORT.PATH                  an ASGI middleware class or an HTTP middleware function
    --disable-fastapi-docs                    no /docs, /redoc, /openapi.json
    --enable-log-requests / --disable-log-requests, --max-log-len   one log line per request
    --disable-log-stats                       no periodic stats line (stats_logger.py)

`check_before_start` is what must fail before the model loads (a port out of
range, a missing TLS or chat-template file, an unreadable model path), each
as one ValueError sentence.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
from dataclasses import dataclass, field
from typing import Any

from tokenmill import envs
from tokenmill.entrypoints.openai.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
)


@dataclass(slots=True)
class CORSOptions:
    allow_origins: list[str]
    allow_methods: list[str]
    allow_headers: list[str]
    allow_credentials: bool


@dataclass(slots=True)
class HTTPOptions:
    """What the HTTP server does besides the routes (built by `http_options_from_args`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    uvicorn_log_level: str = "info"
    access_log: bool = True
    root_path: str = ""
    ssl: dict[str, Any] = field(default_factory=dict)  # uvicorn's ssl_* keyword arguments
    cors: CORSOptions | None = None  # None: no CORS middleware
    middleware: list[str] = field(default_factory=list)  # import paths
    docs: bool = True  # /docs, /redoc, /openapi.json
    log_requests: bool = False
    max_log_len: int | None = None  # characters / token ids shown per prompt (None: all)
    log_stats: bool = True  # the periodic stats line
    # limits.py: request headers / body deadlines (s) and the cap on connections or requests in flight
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `uvicorn.Config` (besides the app and timeouts)."""
        return {"host": self.host, "port": self.port, "log_level": self.uvicorn_log_level,
                "access_log": self.access_log, "root_path": self.root_path, **self.ssl}

    def fastapi_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `FastAPI(...)`: no doc routes with --disable-fastapi-docs."""
        return {} if self.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}


def add_http_cli_args(group: Any) -> None:
    """Add the flags listed in the module docstring to an argparse group."""
    group.add_argument("--root-path", default="", help="ASGI root_path, when a proxy serves the API under a prefix.")
    group.add_argument("--allowed-origins", type=_json_list, default=None,
                       help='CORS allowed origins, a JSON list such as \'["*"]\'. Without any CORS flag no CORS '
                            "headers are sent (vLLM's default is every origin).")
    group.add_argument("--allowed-methods", type=_json_list, default=None,
                       help="CORS allowed methods (JSON list; default all).")
    group.add_argument("--allowed-headers", type=_json_list, default=None,
                       help="CORS allowed headers (JSON list; default all).")
    group.add_argument("--allow-credentials", action="store_true", default=None, help="CORS: allow credentials.")
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key file.")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate file.")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates file, to verify clients.")
    group.add_argument("--ssl-cert-reqs", type=int, default=None,
                       help="Client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*).")
    group.add_argument("--middleware", action="append", default=None, metavar="IMPORT.PATH",
                       help="An ASGI middleware class (app.add_middleware) or an async function(request, "
                            "call_next) (an HTTP middleware); repeat for several, the first given is outermost.")
    group.add_argument("--disable-fastapi-docs", action="store_true", help="Serve no /docs, /redoc, /openapi.json.")
    group.add_argument("--enable-log-requests", action="store_true", default=None,
                       help="Log each request's id, prompt and sampling parameters when it arrives.")
    group.add_argument("--disable-log-requests", action="store_true", default=None,
                       help="Do not log requests (the default; wins over --enable-log-requests).")
    group.add_argument("--max-log-len", type=int, default=None,
                       help="Show at most this many prompt characters and token ids per request log line.")


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [text]  # a bare origin such as http://example.com
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a JSON list of strings, got {text!r}")
    return value


def http_options_from_args(args: Any) -> HTTPOptions:
    """Resolve the parsed flags (an argparse Namespace of `tokenmill serve` or the legacy server)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    cors = None
    if any(get(n) is not None for n in ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials")):
        cors = CORSOptions(allow_origins=get("allowed_origins") or ["*"], allow_methods=get("allowed_methods") or ["*"],
                           allow_headers=get("allowed_headers") or ["*"],
                           allow_credentials=bool(get("allow_credentials")))
    ssl = {f"ssl_{k}": get(f"ssl_{k}") for k in ("keyfile", "certfile", "ca_certs", "cert_reqs")
           if get(f"ssl_{k}") is not None}
    return HTTPOptions(
        host=get("host") or envs.default_host(), port=get("port", 8000), uvicorn_log_level=get("uvicorn_log_level", "info"),
        access_log=not get("disable_uvicorn_access_log", False), root_path=get("root_path") or "", ssl=ssl,
        cors=cors, middleware=list(get("middleware") or []), docs=not get("disable_fastapi_docs", False),
        log_requests=bool(get("enable_log_requests")) and not get("disable_log_requests"),
        max_log_len=get("max_log_len"), log_stats=not get("disable_log_stats", False),
        header_timeout_s=float(get("request_header_timeout", DEFAULT_HEADER_TIMEOUT_S)),
        body_timeout_s=float(get("request_body_timeout", DEFAULT_BODY_TIMEOUT_S)),
        limit_concurrency=get("limit_concurrency", DEFAULT_LIMIT_CONCURRENCY),
    )


def install_http_options(app: Any, opts: HTTPOptions) -> None:
    """Add the CORS and --middleware middlewares to a FastAPI app (call after the app's own middlewares).

    Raises:
        ValueError: a --middleware path that does not import or is neither a class nor a function.
    """
    for path in reversed(opts.middleware):  # the first given ends up outermost
        obj = _import(path)
        if inspect.isclass(obj):
            app.add_middleware(obj)
        elif inspect.iscoroutinefunction(obj):
            app.middleware("http")(obj)
        else:
            raise ValueError(f"--middleware {path} is neither a class nor an async function(request, call_next).")
    if opts.cors is not None:  # outermost, so preflight OPTIONS requests never reach auth
        from fastapi.middleware.cors import CORSMiddleware

        c = opts.cors
        app.add_middleware(CORSMiddleware, allow_origins=c.allow_origins, allow_methods=c.allow_methods,
                           allow_headers=c.allow_headers, allow_credentials=c.allow_credentials)


def _import(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--middleware {path} cannot be imported ({e}); give module.attribute.") from e


def check_before_start(args: Any) -> None:
    """Checks that must fail before the model loads, each with one sentence.

    Raises:
        ValueError: --port outside 0-65535, a --ssl-* or --chat-template file
            that does not exist, or a local model path that cannot be read.
    """
    port = getattr(args, "port", 8000)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535 (0 picks a free port), got {port}.")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name, None)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')} {path}: no such file.")
    if getattr(args, "ssl_keyfile", None) is not None and getattr(args, "ssl_certfile", None) is None:
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate for that key).")
    template = getattr(args, "chat_template", None)
    if template is not None and _looks_like_path(template) and not os.path.isfile(template):
        raise ValueError(f"--chat-template {template}: no such file (give a template file or inline Jinja text).")
    model = getattr(args, "model", None)
    if model is not None and os.path.exists(os.path.expanduser(model)):
        path = os.path.expanduser(model)
        readable = os.access(path, os.R_OK) and (not os.path.isdir(path) or os.access(path, os.X_OK))
        if not readable:
            raise ValueError(f"The model path {model} cannot be read (permission denied); check its permissions.")


def _looks_like_path(text: str) -> bool:
    """A chat template that is meant as a file: no Jinja markup and no line break."""
    return "{" not in text and "\n" not in text
