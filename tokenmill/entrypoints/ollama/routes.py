"""Ollama's HTTP API over the same engine, so Ollama clients work unchanged.

    POST /api/generate   prompt -> text (NDJSON stream by default, or one JSON object)
    POST /api/chat       messages -> assistant message (same streaming rule)
    GET  /api/tags       the served model, as Ollama lists local models
    POST /api/show       its details and chat template
    GET  /api/ps         the "loaded" model (always this one)
    GET  /api/version
    pull / push / create / copy / delete / embed: 501 with a sentence saying why

Streaming (Ollama's default, `"stream": true`) sends one JSON object per line;
the last has `"done": true`, `done_reason` ("stop" or "length") and Ollama's
counters: prompt_eval_count / eval_count (tokens) and *_duration (nanoseconds).
Errors are Ollama's `{"error": "<sentence>"}` (errors.py maps them by path).
Model names match the served name, with or without a ":latest" tag.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.entrypoints.ollama.protocol import ChatRequest, GenerateRequest, OllamaOptions, ShowRequest
from tokenmill.entrypoints.openai.chat_template_guard import ChatTemplatePolicy
from tokenmill.entrypoints.openai.errors import ModelNotFoundError
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.request import structured_outputs_from_fields
from tokenmill.version import get_version

_UNSUPPORTED = ("pull", "push", "create", "copy", "delete", "embed", "embeddings")


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class OllamaServing:
    """Ollama request handling over an `EngineClient` (see module docstring)."""

    def __init__(self, engine: Any, served_model_names: list[str], template_policy: Any = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.template_policy = template_policy or ChatTemplatePolicy()
        self.defaults: dict[str, Any] = dict(getattr(engine, "default_sampling_kwargs", None) or {})

    # -- models ----------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        """The served name `name` refers to.

        Raises:
            ModelNotFoundError: not one of ours (404).
        """
        if not name:
            return self.served_model_names[0]
        for served in self.served_model_names:
            if name in (served, f"{served}:latest") or name.lower() in (served.lower(), f"{served.lower()}:latest"):
                return served
        raise ModelNotFoundError(name, self.served_model_names)

    def _model_path(self) -> str:
        mc = getattr(self.engine, "model_config", None)
        return str(getattr(mc, "gguf_file", None) or getattr(mc, "model_path", None) or "")

    def details(self) -> dict[str, Any]:
        """Ollama's `details` object for the served model."""
        mc = getattr(self.engine, "model_config", None)
        hf = getattr(mc, "hf_config", None)
        family = str(getattr(hf, "model_type", "") or "")
        path = self._model_path()
        quant = re.search(r"(Q\d+_[A-Z0-9_]+|Q\d+|F16|F32|BF16)", os.path.basename(path), re.IGNORECASE)
        return {"parent_model": "", "format": "gguf" if ".gguf" in path.lower() else "safetensors",
                "family": family, "families": [family] if family else None, "parameter_size": "",
                "quantization_level": quant.group(1).upper() if quant else ""}

    def model_entry(self, name: str) -> dict[str, Any]:
        """One model in /api/tags and /api/ps. `digest` names this served model, not a blob."""
        path = self._model_path()
        size = os.path.getsize(path) if path and os.path.isfile(path) else 0
        return {"name": f"{name}:latest", "model": f"{name}:latest", "modified_at": _now_iso(), "size": size,
                "digest": hashlib.sha256(f"{name}\0{path}".encode()).hexdigest(), "details": self.details()}

    def show(self, name: str) -> dict[str, Any]:
        mc = getattr(self.engine, "model_config", None)
        details = self.details()
        arch = details["family"] or "unknown"
        template = getattr(mc, "chat_template", None) or getattr(getattr(self.engine, "tokenizer", None),
                                                                 "chat_template", None) or ""
        return {"modelfile": f"# served by tokenmill\nFROM {name}\n", "parameters": "", "template": template,
                "details": details, "capabilities": ["completion"],
                "model_info": {"general.architecture": arch, f"{arch}.context_length": self.engine.max_model_len}}

    # -- generation ------------------------------------------------------------

    def sampling_params(self, req: GenerateRequest | ChatRequest, num_prompt_tokens: int) -> SamplingParams:
        """Options -> SamplingParams, plus `format` as structured output.

        Raises:
            ValueError: a bad option, a prompt that does not fit, or a bad format (400).
        """
        options = req.options or OllamaOptions()
        params = options.to_sampling_params(num_prompt_tokens, self.engine.max_model_len, req.stream is not False,
                                            self.defaults)
        fmt = req.format
        if fmt:
            if fmt == "json":
                rf: dict[str, Any] = {"type": "json_object"}
            elif isinstance(fmt, dict):
                rf = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
            else:
                raise ValueError(f'format must be "json" or a JSON schema object, got {fmt!r}.')
            params.structured_outputs = structured_outputs_from_fields(rf)
        return params

    def generate_prompt(self, req: GenerateRequest) -> list[int]:
        """Prompt token ids: the raw prompt, or system + prompt through the chat template."""
        if req.images:
            raise ValueError("images are not supported: this server runs a text-only model.")
        if req.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported.")
        if req.raw:
            tok = self.engine.tokenizer
            if tok is None:
                raise ValueError("raw prompts need a tokenizer; this server runs without one.")
            return list(tok.encode(req.prompt or ""))
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
            [{"role": "user", "content": req.prompt or ""}]
        return self.template_policy.render(self.engine, messages, add_generation_prompt=True)

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        """Prompt token ids of the chat messages (the model's chat template)."""
        if req.tools:
            raise ValueError("tools are not supported on /api/chat; use /v1/chat/completions with tools.")
        for i, m in enumerate(req.messages):
            if m.images:
                raise ValueError(f"messages[{i}].images: images are not supported by this text-only model.")
        messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
        return self.template_policy.render(self.engine, messages, add_generation_prompt=True)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        return self.engine.add_request(f"ollama-{uuid.uuid4().hex}", prompt_ids, params)

    @staticmethod
    def final_fields(out: Any, start_ns: int, eval_count: int) -> dict[str, Any]:
        """Ollama's counters for a finished request (durations in nanoseconds).

        `out` is the request's last output; `eval_count` its number of generated tokens (a stream's
        DELTA outputs each hold only their new ones, so the stream counts them).
        """
        comp = out.outputs[0]
        now_ns = time.time_ns()
        m = out.metrics
        first_ns = int(m.first_token_time * 1e9) if m is not None and m.first_token_time else now_ns
        arrival_ns = int(m.arrival_time * 1e9) if m is not None else start_ns
        return {"done": True, "done_reason": comp.finish_reason or "stop", "total_duration": now_ns - start_ns,
                "load_duration": 0, "prompt_eval_count": len(out.prompt_token_ids),
                "prompt_eval_duration": max(0, first_ns - arrival_ns), "eval_count": eval_count,
                "eval_duration": max(0, now_ns - first_ns)}


def build_ollama_router(engine: Any, served_model_names: list[str],
                        unless_disconnected: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
                        template_policy: Any = None) -> APIRouter:
    """The /api/* routes (see module docstring).

    Args:
        engine: the `EngineClient` the OpenAI routes use.
        served_model_names: accepted model names (first = default).
        unless_disconnected: the server's helper that cancels a non-streaming
            request when its client goes away.
    """
    router = APIRouter(prefix="/api")
    serving = OllamaServing(engine, served_model_names, template_policy)

    async def respond(raw_request: Request, model: str, prompt_ids: list[int], params: SamplingParams,
                      stream: bool, piece: Callable[[str], dict[str, Any]]) -> Any:
        """Run one request; `piece(text)` shapes a text chunk (generate: response, chat: message)."""
        start_ns = time.time_ns()
        sub = serving.submit(prompt_ids, params)

        def line(body: dict[str, Any]) -> str:
            return json.dumps({"model": model, "created_at": _now_iso(), **body}) + "\n"

        if stream:
            async def lines() -> AsyncIterator[str]:
                eval_count = 0
                try:
                    async for out in sub:  # DELTA outputs: each holds only its new text and tokens
                        comp = out.outputs[0]
                        eval_count += len(comp.token_ids)
                        if comp.text:
                            yield line({**piece(comp.text), "done": False})
                        if out.finished:
                            yield line({**piece(""), **serving.final_fields(out, start_ns, eval_count)})
                except Exception as exc:  # noqa: BLE001 - after headers: report in-band, as Ollama does
                    yield json.dumps({"error": str(exc)}) + "\n"
                finally:
                    sub.close()

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        async def collect() -> Any:
            last = None
            async for out in sub:
                last = out
            return last

        try:
            last = await unless_disconnected(raw_request, collect())
        finally:
            sub.close()
        if last is None:
            return None
        comp = last.outputs[0]
        return JSONResponse(json.loads(line({**piece(comp.text),
                                             **serving.final_fields(last, start_ns, len(comp.token_ids))})))

    @router.post("/generate")
    async def generate(req: GenerateRequest, raw_request: Request) -> Any:
        model = serving.check_model(req.model)
        if not req.prompt and not req.system:  # Ollama: an empty prompt only loads the model
            return {"model": model, "created_at": _now_iso(), "response": "", "done": True, "done_reason": "load"}
        prompt_ids = serving.generate_prompt(req)
        params = serving.sampling_params(req, len(prompt_ids))
        return await respond(raw_request, model, prompt_ids, params, req.stream is not False,
                             lambda text: {"response": text})

    @router.post("/chat")
    async def chat(req: ChatRequest, raw_request: Request) -> Any:
        model = serving.check_model(req.model)
        if not req.messages:  # Ollama: no messages only loads the model
            return {"model": model, "created_at": _now_iso(), "message": {"role": "assistant", "content": ""},
                    "done": True, "done_reason": "load"}
        prompt_ids = serving.chat_prompt(req)
        params = serving.sampling_params(req, len(prompt_ids))
        return await respond(raw_request, model, prompt_ids, params, req.stream is not False,
                             lambda text: {"message": {"role": "assistant", "content": text}})

    @router.get("/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [serving.model_entry(n) for n in served_model_names]}

    @router.get("/ps")
    async def ps() -> dict[str, Any]:
        models = []
        for n in served_model_names:
            entry = serving.model_entry(n)
            entry.update({"expires_at": "2999-01-01T00:00:00Z", "size_vram": 0})
            models.append(entry)
        return {"models": models}

    @router.post("/show")
    async def show(req: ShowRequest) -> dict[str, Any]:
        return serving.show(serving.check_model(req.model or req.name))

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": get_version()}

    def unsupported(action: str) -> Callable[[], Awaitable[JSONResponse]]:
        async def handler() -> JSONResponse:
            return JSONResponse({"error": f"'{action}' is not supported: tokenmill serves only the model it was "
                                          f"started with ({served_model_names[0]}); restart it with another "
                                          "model instead."}, status_code=501)
        return handler

    for action in _UNSUPPORTED:
        router.add_api_route(f"/{action}", unsupported(action), methods=["POST", "DELETE"], include_in_schema=False)
    return router
